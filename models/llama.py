"""KV-cached Llama with grouped-query attention, RMSNorm, SwiGLU and tied embeddings: the shape
of real small checkpoints (SmolLM2-135M, loaded from its GGUF by ``fxcoalesce.apps.spec.smollm2``).

Same interface as ``models.deepseek``'s target, so EAGLE-3 (``models.eagle3``) drafts for it:

    setup_cache(B, T)                     k_cache / v_cache [B, T, kv, hd], RoPE table [T, hd/2]
    forward(tokens [B, S], input_pos [S], cache_pos [S], mask [B|1, 1, S, T])
        -> logits [B, S, V], hidden [B, S, 3H] (inputs of layers ``args.capture_layers``)

Query/key weights are in GGUF's layout (llama.cpp permutes Hugging Face's rows so that RoPE
rotates adjacent pairs), hence ``rope_interleaved``. Tensor parallelism pads the heads with
zero weights when the key/value heads do not split (SmolLM2: 9/3 heads become 12/4 at TP 2):
a zero query head attends uniformly over zero values and its ``wo`` columns are zero, so the
padded model computes exactly what the original does. Sequential blocks: the all_reduces
form one chain, already at their bound.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .capture import capture_layers, check_capture_layers
from .deepseek import init_weights_
from .rope import rope_interleaved, rope_table
from .tp import (Group, VocabParallelEmbedding, all_gather_last_dim, all_reduce,
                 check_divisible, shard_linear_, world_of)


@dataclass(kw_only=True, frozen=True)
class LlamaArgs:
    vocab: int
    """Vocabulary size."""
    dim: int
    """Hidden size H."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads; divides n_heads (grouped-query attention)."""
    inter_dim: int
    """SwiGLU hidden size."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_seq_len: int = 2048
    """Context length (RoPE positions); also the default KV cache length."""
    eagle_layers: tuple[int, ...] | None = None
    """Three distinct layers whose input hidden states forward() returns; None: EAGLE-3's
    (2, L // 2, L - 3), or (0, L // 2, L - 1) below 7 layers (as ``deepseek.MoEArgs``)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "inter_dim",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"n_heads ({self.n_heads}) must divide dim ({self.dim}) into even "
                             "head dims")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads "
                             f"({self.n_heads})")
        check_capture_layers(self.n_layers, self.eagle_layers)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The layers whose input hidden states are captured, in concatenation order."""
        return capture_layers(self.n_layers, self.eagle_layers)


CONFIGS: dict[str, LlamaArgs] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (the GGUF's metadata is checked against this)
    "smollm2-135m": LlamaArgs(vocab=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                              inter_dim=1536, rope_theta=100000.0, norm_eps=1e-5,
                              max_seq_len=8192),
    # meta-llama/Meta-Llama-3-8B: the common served shape; sequential blocks, nothing to merge
    "llama-3-8b": LlamaArgs(vocab=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            inter_dim=14336, rope_theta=500000.0, norm_eps=1e-5,
                            max_seq_len=8192),
}

TINY = LlamaArgs(vocab=256, dim=72, n_layers=4, n_heads=9, n_kv_heads=3, inter_dim=96,
                 rope_theta=100000.0, max_seq_len=256)
"""SmolLM2's head layout (9 query / 3 key-value heads) at toy size, for tests."""


def padded_kv_heads(n_kv_heads: int, world: int) -> int:
    """Key/value heads after zero-padding so that ``world`` ranks each get whole heads."""
    return -(-n_kv_heads // world) * world


class Attention(nn.Module):
    """GQA attention: query head i reads key/value head i // (n_heads / n_kv_heads)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        hd = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.group: Group = None

    def forward(self, x, rot, cache_pos, mask):
        """x [B, S, H], rot (cos, sin) [S, hd/2], cache_pos [S], mask [B|1, 1, S, T]"""
        B, S, _ = x.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        g = h // kv
        cos, sin = (t[:, None] for t in rot)
        q = rope_interleaved(self.wq(x).view(B, S, h, hd), cos, sin)
        k = rope_interleaved(self.wk(x).view(B, S, kv, hd), cos, sin)
        k_cache, v_cache = self.k_cache[:B], self.v_cache[:B]  # [B, T, kv, hd]
        k_cache.index_copy_(1, cache_pos, k)
        v_cache.index_copy_(1, cache_pos, self.wv(x).view(B, S, kv, hd))
        # the g query heads of a key/value head become g * S rows: no key/value copies
        q = q.view(B, S, kv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, kv, g * S, hd)
        mask = mask.repeat(1, 1, g, 1) if g > 1 else mask  # [B|1, 1, gS, T]
        o = F.scaled_dot_product_attention(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                           attn_mask=mask)  # [B, kv, gS, hd]
        o = o.view(B, kv, g, S, hd).permute(0, 3, 1, 2, 4).reshape(B, S, h * hd)
        return all_reduce(self.wo(o), self.group)


class MLP(nn.Module):
    """SwiGLU: column-parallel w1 (gate) and w3 (up), row-parallel w2 (down)."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.group: Group = None

    def forward(self, x):
        return all_reduce(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.group)


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attn, self.mlp = Attention(args), MLP(args.dim, args.inter_dim)
        self.attn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, rot, cache_pos, mask):  # [B, S, H]
        x = x + self.attn(self.attn_norm(x), rot, cache_pos, mask)
        return x + self.mlp(self.ffn_norm(x))


class Transformer(nn.Module):
    """Vocab-parallel embedding, blocks, final norm, and the embedding as the output head
    (tied: under TP each rank's head is its embedding shard, then one all_gather)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.embed = VocabParallelEmbedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.register_buffer("rope_cos", None, persistent=False)  # [T, hd/2]: setup_cache
        self.register_buffer("rope_sin", None, persistent=False)
        self.group: Group = None

    def setup_cache(self, max_batch_size: int = 1, max_seq_len: int | None = None,
                    dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> None:
        """Allocate each layer's k_cache / v_cache [B, T, local kv heads, hd] (zeros), and the
        RoPE table of positions 0..T-1 (``rope_cos`` / ``rope_sin``). Call it after
        ``apply_tp`` (which changes the local head count)."""
        T = max_seq_len or self.args.max_seq_len
        dtype, device = dtype or self.norm.weight.dtype, device or self.norm.weight.device
        self.rope_cos, self.rope_sin = rope_table(T, self.args.head_dim, self.args.rope_theta,
                                                  torch.promote_types(dtype, torch.float32),
                                                  device)
        for layer in self.layers:
            a = layer.attn
            shape = (max_batch_size, T, a.n_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            a.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def features(self, tokens, input_pos, cache_pos, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The final normed hidden state [B, S, H] (the head's input) and the captured
        states [B, S, 3H]; ``forward`` without the vocabulary projection."""
        if self.layers[0].attn.k_cache is None:
            raise RuntimeError("KV cache missing: call model.setup_cache() after apply_tp")
        h = self.embed(tokens)  # [B, S, H]
        rot_dtype = torch.promote_types(h.dtype, torch.float32)
        rot = tuple(t[input_pos].to(rot_dtype) for t in (self.rope_cos, self.rope_sin))
        capture, captured = self.args.capture_layers, {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = h
            h = layer(h, rot, cache_pos, mask)
        return self.norm(h), torch.cat([captured[i] for i in capture], -1)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache_pos: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S]; input_pos [S] RoPE positions; cache_pos [S] KV slots to write;
        mask [B|1, 1, S, T] bool (True: may attend) -> logits [B, S, V], hidden [B, S, 3H]."""
        h, hidden = self.features(tokens, input_pos, cache_pos, mask)
        return all_gather_last_dim(F.linear(h, self.embed.weight), self.group), hidden


def check_tp(args: LlamaArgs, world: int) -> None:
    """Raise ValueError unless ``world`` ranks can split these sizes evenly (heads always
    split: ``apply_tp`` pads them)."""
    check_divisible("the MLP hidden size (inter_dim)", args.inter_dim, world)
    check_divisible("the vocabulary (vocab)", args.vocab, world)


def pad_heads_(attn: Attention, n_kv_heads: int) -> None:
    """Append zero key/value heads (and their zero query heads and ``wo`` columns) until
    there are ``n_kv_heads``; the output is unchanged."""
    g, hd, extra = attn.n_heads // attn.n_kv_heads, attn.head_dim, n_kv_heads - attn.n_kv_heads
    if extra <= 0:
        return

    def grow(linear: nn.Linear, dim: int, size: int) -> None:
        w = linear.weight.detach()
        shape = list(w.shape)
        shape[dim] = size
        linear.weight = nn.Parameter(torch.cat([w, w.new_zeros(shape)], dim),
                                     requires_grad=linear.weight.requires_grad)
        linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]

    grow(attn.wq, 0, extra * g * hd)
    grow(attn.wk, 0, extra * hd)
    grow(attn.wv, 0, extra * hd)
    grow(attn.wo, 1, extra * g * hd)
    attn.n_kv_heads, attn.n_heads = n_kv_heads, n_kv_heads * g


def apply_tp(model: Transformer, group: Group, *, keep_collectives: bool = False
             ) -> Transformer:
    """Shard ``model`` in place over ``group`` (no-op for None): heads (zero-padded to a
    multiple of the world size), FFN and vocabulary split; norms replicated. Drops any KV
    cache (its head count changes): call ``setup_cache`` afterwards."""
    rank, world = world_of(group)
    if group is None or (world == 1 and not keep_collectives):  # (a group of one rank keeps
        return model                                             # its no-op all_reduces)
    args = model.args
    check_tp(args, world)
    kv = padded_kv_heads(args.n_kv_heads, world)
    model.embed.shard_(group)
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        pad_heads_(attn, kv)
        for linear in (attn.wq, attn.wk, attn.wv, mlp.w1, mlp.w3):
            shard_linear_(linear, "colwise", rank, world)
        shard_linear_(attn.wo, "rowwise", rank, world)
        shard_linear_(mlp.w2, "rowwise", rank, world)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // world, kv // world
        attn.k_cache = attn.v_cache = None
        attn.group = mlp.group = group
    model.group = group
    return model


def build(name_or_args: str | LlamaArgs, *, hand_merged: bool = False,
          dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
          seed: int = 0) -> Transformer:
    """The unsharded model with seeded weights (works under ``FakeTensorMode``); real weights
    come from ``fxcoalesce.apps.spec.smollm2.load_target``."""
    if hand_merged:
        raise ValueError("Llama blocks are sequential: there is no hand-merged variant")
    if isinstance(name_or_args, str):
        if name_or_args not in CONFIGS:
            raise ValueError(f"unknown model {name_or_args!r}; choose one of {sorted(CONFIGS)}")
        name_or_args = CONFIGS[name_or_args]
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = Transformer(name_or_args)
    init_weights_(model, seed, dtype)
    return model.eval()
