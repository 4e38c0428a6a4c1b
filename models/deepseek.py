"""DeepSeek-V3 / Kimi-K2: MLA attention + sigmoid-routed MoE, after deepseek-ai/DeepSeek-V3's
``inference/model.py``, rewritten for static shapes so ``torch.compile(fullgraph=True)`` traces
it with no graph break or host sync at any size.

Tensor parallelism (``apply_tp``) follows the reference: per forward one all_reduce for the
vocab-parallel embedding, one per attention (row-parallel ``wo``), one per dense MLP, and per
MoE one for the routed experts plus one for the shared expert (``hand_merged`` sums the two
partial outputs first, as vLLM and SGLang do, leaving one). Kimi-K2: 1 + 61 + 1 + 2 * 60 = 183
all_reduces per forward, 123 hand-merged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .capture import capture_layers, check_capture_layers
from .rope import rope_interleaved, rope_table
from .tp import (
    Group,
    VocabParallelEmbedding,
    all_gather_last_dim,
    all_reduce,
    check_divisible,
    shard_linear_,
    shard_param_,
    world_of,
)


@dataclass(kw_only=True, frozen=True)
class MoEArgs:
    vocab: int
    """Vocabulary size."""
    dim: int
    """Hidden size H."""
    inter_dim: int
    """FFN size of the leading dense layers."""
    moe_inter_dim: int
    """FFN size of each routed expert (the shared expert has n_shared_experts times it)."""
    n_layers: int
    """Number of transformer blocks."""
    n_dense_layers: int
    """Leading blocks with a dense MLP instead of MoE (HF: first_k_dense_replace)."""
    n_heads: int
    """Attention heads."""
    n_routed_experts: int
    """Routed experts per MoE layer."""
    n_shared_experts: int
    """Shared experts per MoE layer, fused into one MLP; at least 1."""
    n_activated_experts: int
    """Routed experts chosen per token (top-k)."""
    n_expert_groups: int = 1
    """Groups the routed experts are split into for group-limited routing."""
    n_limited_groups: int = 1
    """Groups a token may route to (top groups by the sum of their two best scores)."""
    route_scale: float = 1.0
    """Multiplier on the normalised routing weights."""
    q_lora_rank: int
    """Rank of the query down-projection (0: full-rank wq)."""
    kv_lora_rank: int
    """Rank of the compressed key/value latent (what the KV cache stores)."""
    qk_nope_head_dim: int
    """Per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head query/key dims with rotary embedding (key part shared by all heads)."""
    v_head_dim: int
    """Per-head value dims."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_seq_len: int = 16384
    """Default KV cache length for setup_cache."""
    max_batch_size: int = 8
    """Default KV cache batch size for setup_cache."""
    eagle_layers: tuple[int, ...] | None = None
    """Three distinct layers whose input hidden states forward() returns for EAGLE-3; None: the
    EAGLE-3 default (2, L // 2, L - 3), or (0, L // 2, L - 1) when L < 7 makes the default
    collide, so replace(args, n_layers=...) keeps working. ``capture_layers`` is the resolved
    tuple."""
    hand_merged: bool = False
    """Sum shared and routed expert outputs before one all_reduce (vLLM/SGLang's hand merge)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads",
                     "n_routed_experts", "n_shared_experts", "n_activated_experts",
                     "n_expert_groups", "n_limited_groups", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "max_seq_len", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArgs.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers ({self.n_dense_layers}) must be in [0, n_layers]")
        if self.q_lora_rank < 0:
            raise ValueError("q_lora_rank must be >= 0 (0 means a full-rank query projection)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError(f"n_expert_groups ({self.n_expert_groups}) must divide "
                             f"n_routed_experts ({self.n_routed_experts})")
        per_group = self.n_routed_experts // self.n_expert_groups
        if self.n_limited_groups > self.n_expert_groups:
            raise ValueError(f"n_limited_groups ({self.n_limited_groups}) must be <= "
                             f"n_expert_groups ({self.n_expert_groups})")
        if self.n_expert_groups > 1 and per_group < 2:
            raise ValueError("group-limited routing scores a group by its two best experts; "
                             "use n_routed_experts >= 2 * n_expert_groups")
        if self.n_activated_experts > self.n_limited_groups * per_group:
            raise ValueError(f"n_activated_experts ({self.n_activated_experts}) exceeds the "
                             f"{self.n_limited_groups * per_group} experts in the allowed groups")
        check_capture_layers(self.n_layers, self.eagle_layers)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The layers whose input hidden states are captured, in concatenation order."""
        return capture_layers(self.n_layers, self.eagle_layers)


_FULL = dict(dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_shared_experts=1,
             n_activated_experts=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
             qk_rope_head_dim=64, v_head_dim=128)

CONFIGS: dict[str, MoEArgs] = {
    "kimi-k2": MoEArgs(**_FULL, vocab=163840, n_dense_layers=1, n_heads=64, n_routed_experts=384,
                       route_scale=2.827, rope_theta=50000.0),
    "deepseek-v3": MoEArgs(**_FULL, vocab=129280, n_dense_layers=3, n_heads=128,
                           n_routed_experts=256, n_expert_groups=8, n_limited_groups=4,
                           route_scale=2.5),
    "kimi-k2-tiny": MoEArgs(vocab=512, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=4,
                            n_dense_layers=1, n_heads=8, n_routed_experts=8, n_shared_experts=1,
                            n_activated_experts=2, route_scale=2.827, q_lora_rank=32,
                            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, rope_theta=50000.0, max_seq_len=256, max_batch_size=2),
}


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def causal_mask(cache_pos: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[1, 1, S, max_seq_len] bool: token s sees cache slots <= cache_pos[s] (prefill/decode)."""
    slots = torch.arange(max_seq_len, device=cache_pos.device)
    return (slots[None, :] <= cache_pos[:, None])[None, None]


class MLA(nn.Module):
    """Multi-head latent attention in the reference's "absorb" form: the cache keeps, per token,
    the normalised kv latent and the roped key part shared by all heads, concatenated
    ([B, T, kv_lora_rank + rope_dim], as FlashMLA) and replicated over TP ranks; wkv_b is folded
    into the query and the output of each head."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_local_heads = args.n_heads
        self.nope, self.rope, self.v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_head_dim = self.nope + self.rope
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope + self.v), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v, args.dim, bias=False)
        self.softmax_scale = qk_head_dim**-0.5
        self.register_buffer("kv_cache", None, persistent=False)
        self.group: Group = None

    def query(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, S, h * qk_head_dim]
        return self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)

    def forward(self, x, rot, cache_pos, mask):
        """x [B, S, H], rot (cos, sin) [S, r/2], cache_pos [S], mask [B|1, 1, S, T] -> [B, S, H]"""
        B, S, _ = x.shape
        h, c = self.n_local_heads, self.kv_lora_rank
        kv, k_pe = self.wkv_a(x).split([c, self.rope], -1)  # [B, S, c], [B, S, r]
        cache = self.kv_cache[:B]  # [B, T, c + r]
        k_pe = rope_interleaved(k_pe, *rot)
        cache.index_copy_(1, cache_pos, torch.cat([self.kv_norm(kv), k_pe], -1))

        # batched matmuls rather than einsums: far fewer ATen ops to trace at 61 layers
        q = self.query(x).view(B * S, h, -1).transpose(0, 1)  # [h, BS, nope + r]
        q_nope, q_pe = q.split([self.nope, self.rope], -1)
        wkv_b = self.wkv_b.weight.view(h, self.nope + self.v, c)
        q_pe = rope_interleaved(q_pe.view(h, B, S, -1), *rot).flatten(1, 2)  # [h, BS, r]
        q_lat = torch.cat([torch.bmm(q_nope, wkv_b[:, : self.nope]), q_pe], -1)  # [h, BS, c + r]
        q_lat = q_lat.view(h, B, S, -1).transpose(0, 1).reshape(B, h * S, -1)  # [B, hS, c + r]
        scores = torch.bmm(q_lat, cache.transpose(1, 2)).view(B, h, S, -1) * self.softmax_scale
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.softmax(-1, dtype=_acc(x.dtype)).type_as(x)
        out = torch.bmm(scores.view(B, h * S, -1), cache[..., :c])  # [B, hS, c]
        out = out.view(B, h, S, c).transpose(0, 1).reshape(h, B * S, c)
        out = torch.bmm(out, wkv_b[:, -self.v :].transpose(1, 2))  # [h, BS, v]
        out = out.transpose(0, 1).reshape(B, S, h * self.v)
        return all_reduce(self.wo(out), self.group)  # [B, S, H]


class MLP(nn.Module):
    """SwiGLU FFN: column-parallel w1/w3, row-parallel w2 and one all_reduce."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.group: Group = None

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H], this rank's share
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x), self.group)


class Gate(nn.Module):
    """noaux_tc router: sigmoid scores; selection on scores + bias (group-limited when
    n_expert_groups > 1); weights = the chosen experts' unbiased scores, normalised, scaled."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.topk, self.route_scale = args.n_activated_experts, args.route_scale
        self.n_groups, self.topk_groups = args.n_expert_groups, args.n_limited_groups
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [T, H]
        scores = F.linear(x.to(_acc(x.dtype)), self.weight.to(_acc(x.dtype))).sigmoid()  # [T, E]
        biased = scores + self.bias
        if self.n_groups > 1:
            grouped = biased.unflatten(-1, (self.n_groups, -1))  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(self.topk_groups, dim=-1).indices  # [T, g]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, keep, False)
            biased = grouped.masked_fill(dropped[..., None], float("-inf")).flatten(1)
        ids = biased.topk(self.topk, dim=-1).indices  # [T, K]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * self.route_scale
        return weights.type_as(x), ids  # [T, K], [T, K]


def experts_gathered(x, w1, w2, w3, ids, weights):
    """Routed output from the chosen experts' weights, gathered per token: cheap when
    T * K < local experts (decode). x [T, H], w1/w3 [E, F, H], w2 [E, H, F], ids/weights [T, K]."""
    T, K = ids.shape
    xs = x[:, :, None]  # [T, H, 1]
    gate = torch.bmm(w1[ids].flatten(1, 2), xs)  # [T, KF, 1]
    h = F.silu(gate) * torch.bmm(w3[ids].flatten(1, 2), xs)
    h = h.view(T * K, -1, 1) * weights.reshape(T * K, 1, 1)  # [TK, F, 1]
    return torch.bmm(w2[ids].flatten(0, 1), h).view(T, K, -1).sum(1)  # [T, H]


def experts_dense(x, w1, w2, w3, combine):
    """Routed output running every local expert on every token, weighted by ``combine`` [T, E]
    (zero for experts a token did not choose): reads each expert's weights once (prefill,
    verify)."""
    xe = x.expand(w1.shape[0], -1, -1)  # [E, T, H]
    h = F.silu(torch.bmm(xe, w1.transpose(1, 2))) * torch.bmm(xe, w3.transpose(1, 2))  # [E, T, F]
    return torch.bmm(h * combine.t()[..., None], w2.transpose(1, 2)).sum(0)  # [T, H]


class MoE(nn.Module):
    """Routed experts stacked as w1/w3 [E, F, H], w2 [E, H, F] (rank r keeps experts
    [r E/W, (r+1) E/W) and zero-weights the rest), plus a TP-sharded shared expert."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        E, F_, H = args.n_routed_experts, args.moe_inter_dim, args.dim
        self.gate = Gate(args)
        self.w1 = nn.Parameter(torch.empty(E, F_, H))
        self.w2 = nn.Parameter(torch.empty(E, H, F_))
        self.w3 = nn.Parameter(torch.empty(E, F_, H))
        self.shared = MLP(H, args.n_shared_experts * F_)
        self.expert_start = 0
        self.hand_merged = args.hand_merged
        self.group: Group = None

    def routed(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H], this rank's experts
        weights, ids = self.gate(x)  # [T, K]
        n_local = self.w1.shape[0]
        if ids.numel() < n_local:
            local = ids - self.expert_start
            on_rank = (local >= 0) & (local < n_local)
            return experts_gathered(x, self.w1, self.w2, self.w3,
                                    local.clamp(0, n_local - 1), weights * on_rank)
        combine = torch.zeros(x.shape[0], self.gate.weight.shape[0], dtype=x.dtype, device=x.device)
        combine = combine.scatter(1, ids, weights)  # [T, E], zero where not chosen
        combine = combine[:, self.expert_start : self.expert_start + n_local]
        return experts_dense(x, self.w1, self.w2, self.w3, combine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        flat = x.flatten(0, 1)  # [T, H]
        y = self.routed(flat)
        if self.hand_merged:
            return all_reduce(y + self.shared.partial(flat), self.group).view_as(x)
        z = self.shared(flat)
        return (all_reduce(y, self.group) + z).view_as(x)


class Block(nn.Module):
    """Pre-norm block: MLA, then a dense MLP (first n_dense_layers blocks) or MoE."""

    def __init__(self, layer_id: int, args: MoEArgs):
        super().__init__()
        self.attn = MLA(args)
        self.ffn = MLP(args.dim, args.inter_dim) if layer_id < args.n_dense_layers else MoE(args)
        self.attn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, rot, cache_pos, mask):  # [B, S, H]
        x = x + self.attn(self.attn_norm(x), rot, cache_pos, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """Vocab-parallel embedding, blocks, final norm, column-parallel head; forward also returns
    the hidden states EAGLE-3 drafts from."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.embed = VocabParallelEmbedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)
        self.register_buffer("rope_cos", None, persistent=False)  # [T, r/2]: setup_cache
        self.register_buffer("rope_sin", None, persistent=False)
        self.group: Group = None

    def setup_cache(self, max_batch_size: int | None = None, max_seq_len: int | None = None,
                    dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> None:
        """Allocate each layer's latent cache [B, T, kv_lora_rank + qk_rope_head_dim] (zeros)
        and the RoPE table of positions 0..T-1 (``rope_cos`` / ``rope_sin``, as in llama.py);
        defaults come from args and the weights."""
        B = max_batch_size or self.args.max_batch_size
        T = max_seq_len or self.args.max_seq_len
        dtype = dtype or self.head.weight.dtype
        device = device or self.head.weight.device
        width = self.args.kv_lora_rank + self.args.qk_rope_head_dim
        self.rope_cos, self.rope_sin = rope_table(T, self.args.qk_rope_head_dim,
                                                  self.args.rope_theta, _acc(dtype), device)
        for layer in self.layers:
            layer.attn.kv_cache = torch.zeros(B, T, width, dtype=dtype, device=device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache_pos: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S]; input_pos [S] RoPE positions; cache_pos [S] KV slots to write;
        mask [B|1, 1, S, T] bool (True: may attend) -> logits [B, S, V], hidden [B, S, 3H]
        (the hidden states entering layers ``args.capture_layers``)."""
        if self.layers[0].attn.kv_cache is None:
            raise RuntimeError("KV cache missing: call model.setup_cache() before forward")
        h = self.embed(tokens)  # [B, S, H]
        # (cos, sin) [S, r/2]. Plain RoPE: the checkpoints' YaRN extension only changes
        # these constants (and the softmax scale), not the graph, so it is left out.
        rot = tuple(t[input_pos].to(_acc(h.dtype)) for t in (self.rope_cos, self.rope_sin))
        capture, captured = self.args.capture_layers, {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = h
            h = layer(h, rot, cache_pos, mask)
        logits = all_gather_last_dim(self.head(self.norm(h)), self.group)  # [B, S, V]
        return logits, torch.cat([captured[i] for i in capture], -1)


def check_tp(args: MoEArgs, world: int) -> None:
    """Raise ValueError unless ``world`` ranks can split these sizes evenly: what ``apply_tp``
    requires, checkable before any weight exists."""
    check_divisible("the attention heads (n_heads)", args.n_heads, world)
    check_divisible("the routed experts (n_routed_experts)", args.n_routed_experts, world)
    check_divisible("the vocabulary (vocab)", args.vocab, world)
    check_divisible("the dense FFN size (inter_dim)", args.inter_dim, world)
    check_divisible("the shared expert FFN size (n_shared_experts * moe_inter_dim)",
                    args.n_shared_experts * args.moe_inter_dim, world)


def apply_tp(model: Transformer, group: Group, *, keep_collectives: bool = True
             ) -> Transformer:
    # keep_collectives: the families' common keyword; a group of one rank always keeps its
    # (no-op) all_reduces here
    """Shard ``model`` in place over ``group`` (no-op for None): heads, routed experts, FFNs and
    vocabulary split evenly; the router, norms, MLA down-projections and KV cache replicated."""
    if group is None:
        return model
    rank, world = world_of(group)
    args = model.args
    check_tp(args, world)

    def shard_mlp(mlp: MLP) -> None:
        shard_linear_(mlp.w1, "colwise", rank, world)
        shard_linear_(mlp.w3, "colwise", rank, world)
        shard_linear_(mlp.w2, "rowwise", rank, world)
        mlp.group = group

    model.embed.shard_(group)
    for layer in model.layers:
        attn = layer.attn
        shard_linear_(attn.wq_b if hasattr(attn, "wq_b") else attn.wq, "colwise", rank, world)
        shard_linear_(attn.wkv_b, "colwise", rank, world)
        shard_linear_(attn.wo, "rowwise", rank, world)
        attn.n_local_heads = args.n_heads // world
        attn.group = group
        if isinstance(layer.ffn, MoE):
            moe = layer.ffn
            for name in ("w1", "w2", "w3"):
                shard_param_(moe, name, 0, rank, world)
            moe.expert_start = rank * (args.n_routed_experts // world)
            shard_mlp(moe.shared)
            moe.group = group
        else:
            shard_mlp(layer.ffn)
    shard_linear_(model.head, "colwise", rank, world)
    model.group = group
    return model


def init_weights_(model: nn.Module, seed: int, dtype: torch.dtype) -> None:
    """Replace every parameter by a seeded one of ``dtype``: matrices N(0, 1/fan_in) (fan_in =
    last dim) so activations stay O(1) at any width, vectors N(0, 0.02) (the router bias),
    RMSNorm weights 1. (Fresh parameters rather than ``.to(dtype)``, which fails on fake ones.)"""
    gen = None
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if gen is None or gen.device != p.device:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            new = torch.empty(p.shape, dtype=dtype, device=p.device)
            if isinstance(module, nn.RMSNorm):
                new.fill_(1.0)
            else:
                new.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02, generator=gen)
            setattr(module, name, nn.Parameter(new))


def build(name_or_args: str | MoEArgs, *, hand_merged: bool = False,
          dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
          seed: int = 0) -> Transformer:
    """Unsharded model with deterministic weights. Full-size configs (~1T parameters for
    kimi-k2) must be built inside ``FakeTensorMode``."""
    if isinstance(name_or_args, str):
        if name_or_args not in CONFIGS:
            raise ValueError(f"unknown model {name_or_args!r}; choose one of {sorted(CONFIGS)}")
        name_or_args = CONFIGS[name_or_args]
    args = replace(name_or_args, hand_merged=True) if hand_merged else name_or_args
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the final dtype: a float32 copy may not fit
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = Transformer(args)
    finally:
        torch.set_default_dtype(previous)
    init_weights_(model, seed, dtype)
    return model
