"""Dense tensor-parallel decoders: Llama-style sequential blocks and GPT-NeoX/Falcon-style
parallel blocks (attention and MLP read the same input and both add to the residual).

    sequential:  h = x + attn(norm1(x));  out = h + mlp(norm2(h))     2 chained all_reduces
    parallel:    out = x + attn(norm1(x)) + mlp(norm2(x))             2 independent ones

Plain causal self-attention over the given tokens (no KV cache): enough to show where the
collectives sit. ``apply_tp`` shards Megatron-style; see ``tp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .rope import rope_angles, rope_interleaved
from .tp import (Group, VocabParallelEmbedding, all_gather_last_dim, all_reduce,
                 check_divisible, shard_linear_, world_of)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelArgs:
    """Sizes and block style of a dense decoder."""

    vocab: int
    """Vocabulary size."""
    dim: int
    """Hidden size."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Attention (query) heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than n_heads)."""
    inter_dim: int
    """MLP hidden size."""
    parallel_block: bool = False
    """GPT-NeoX/Falcon block: attention and MLP in parallel on the same input."""
    gated_mlp: bool = True
    """SwiGLU MLP (Llama) rather than GELU (NeoX/Falcon)."""
    layer_norm: bool = False
    """LayerNorm (NeoX/Falcon) rather than RMSNorm (Llama)."""
    hand_merged: bool = False
    """Parallel blocks only: sum attention and MLP before one all_reduce (the engines' merge)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """Normalisation epsilon."""

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must divide dim and n_kv_heads must divide n_heads")
        if self.hand_merged and not self.parallel_block:
            raise ValueError("hand_merged applies to parallel blocks only")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


CONFIGS = {
    "llama-tiny": ModelArgs(vocab=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=4,
                            inter_dim=128),
    "neox-tiny": ModelArgs(vocab=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=4,
                           inter_dim=256, parallel_block=True, gated_mlp=False,
                           layer_norm=True),
    "llama-3-70b": ModelArgs(vocab=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                             inter_dim=28672, rope_theta=500000.0),
    "falcon-40b": ModelArgs(vocab=65024, dim=8192, n_layers=60, n_heads=128, n_kv_heads=8,
                            inter_dim=32768, parallel_block=True, gated_mlp=False,
                            layer_norm=True),
}


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:  # [B, S, h, d] -> same
    cos, sin = rope_angles(torch.arange(x.shape[1], device=x.device), x.shape[-1], theta)
    return rope_interleaved(x, cos[:, None], sin[:, None])


def make_norm(args: ModelArgs) -> nn.Module:
    return (nn.LayerNorm(args.dim, eps=args.norm_eps) if args.layer_norm
            else nn.RMSNorm(args.dim, eps=args.norm_eps))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.group: Group = None

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> this rank's share
        b, s, _ = x.shape
        hd = self.args.head_dim
        q = rope(self.wq(x).view(b, s, self.n_heads, hd), self.args.rope_theta)
        k = rope(self.wk(x).view(b, s, self.n_kv_heads, hd), self.args.rope_theta)
        v = self.wv(x).view(b, s, self.n_kv_heads, hd)
        rep = self.n_heads // self.n_kv_heads
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                           is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        return all_reduce(self.partial(x), self.group)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gated = args.gated_mlp
        self.w1 = nn.Linear(args.dim, args.inter_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.inter_dim, bias=False) if self.gated else None
        self.w2 = nn.Linear(args.inter_dim, args.dim, bias=False)
        self.group: Group = None

    def partial(self, x):
        h = F.silu(self.w1(x)) * self.w3(x) if self.gated else F.gelu(self.w1(x))
        return self.w2(h)

    def forward(self, x):
        return all_reduce(self.partial(x), self.group)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.attn, self.mlp = Attention(args), MLP(args)
        self.attn_norm, self.mlp_norm = make_norm(args), make_norm(args)
        self.group: Group = None

    def forward(self, x):  # [B, S, D]
        if not self.args.parallel_block:
            h = x + self.attn(self.attn_norm(x))
            return h + self.mlp(self.mlp_norm(h))
        if self.args.hand_merged:
            both = self.attn.partial(self.attn_norm(x)) + self.mlp.partial(self.mlp_norm(x))
            return x + all_reduce(both, self.group)
        return x + self.attn(self.attn_norm(x)) + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = VocabParallelEmbedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = make_norm(args)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)
        self.group: Group = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, V]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return all_gather_last_dim(self.head(self.norm(x)), self.group)


def check_tp(args: ModelArgs, world: int) -> None:
    """Raise ValueError unless ``world`` ranks can split these sizes evenly: what ``apply_tp``
    requires, checkable before any weight exists (n_kv_heads divides n_heads, so query heads
    split too)."""
    check_divisible("the key/value heads", args.n_kv_heads, world)
    check_divisible("the MLP hidden size", args.inter_dim, world)
    check_divisible("the vocabulary", args.vocab, world)


def apply_tp(model: Transformer, group: Group, *, keep_collectives: bool = False
             ) -> Transformer:
    """Shard ``model`` in place over ``group``: heads and FFN columns split, vocab split."""
    rank, world = world_of(group)
    if group is None or (world == 1 and not keep_collectives):  # (a group of one rank keeps
        return model                                             # its no-op all_reduces)
    a = model.args
    check_tp(a, world)
    model.embed.shard_(group)
    for layer in model.layers:
        att = layer.attn
        for lin in (att.wq, att.wk, att.wv):
            shard_linear_(lin, "colwise", rank, world)
        shard_linear_(att.wo, "rowwise", rank, world)
        att.n_heads, att.n_kv_heads = a.n_heads // world, a.n_kv_heads // world
        for lin in (layer.mlp.w1, layer.mlp.w3):
            if lin is not None:
                shard_linear_(lin, "colwise", rank, world)
        shard_linear_(layer.mlp.w2, "rowwise", rank, world)
        layer.group = att.group = layer.mlp.group = group
    shard_linear_(model.head, "colwise", rank, world)
    model.group = group
    return model


def build(name_or_args: str | ModelArgs, *, hand_merged: bool = False,
          dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
          seed: int = 0) -> Transformer:
    """The unsharded model with seeded weights (works under ``FakeTensorMode`` too)."""
    args = CONFIGS[name_or_args] if isinstance(name_or_args, str) else name_or_args
    if hand_merged:
        args = replace(args, hand_merged=True)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device or "cpu"):
            return Transformer(args).eval()
    finally:
        torch.set_default_dtype(previous)
