"""Tensor-parallel building blocks shared by the models (Megatron-style, as in gpt-fast).

A model is built whole and unsharded; its ``apply_tp(model, group)`` then narrows weights in
place with the helpers below and hands ``group`` to the modules that communicate. Every
collective goes through ``torch.distributed._functional_collectives`` so that dynamo traces
it as ``_c10d_functional.all_reduce`` + ``wait_tensor``.

    column-parallel linear: weight [out, in] keeps rows   out/world * rank ...  (no comm)
    row-parallel linear:    weight [out, in] keeps cols   in/world * rank ...   all_reduce after
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

Group = dist.ProcessGroup | None


def world_of(group: Group) -> tuple[int, int]:
    """(rank, world size) of ``group``; (0, 1) when there is no group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_divisible(what: str, size: int, world: int) -> None:
    """Raise a readable error when ``size`` cannot be split evenly over ``world`` ranks."""
    if size % world:
        raise ValueError(
            f"tensor parallelism {world} does not divide {what} ({size}); "
            f"choose a TP degree that divides {size}"
        )


def shard_param_(module: nn.Module, name: str, dim: int, rank: int, world: int) -> None:
    """Keep this rank's contiguous 1/world slice of ``module.<name>`` along ``dim``."""
    p = getattr(module, name)
    check_divisible(f"{type(module).__name__}.{name} dim {dim}", p.shape[dim], world)
    part = p.detach().chunk(world, dim=dim)[rank].clone()
    setattr(module, name, nn.Parameter(part, requires_grad=p.requires_grad))


def shard_linear_(linear: nn.Linear, style: str, rank: int, world: int) -> None:
    """Shard an ``nn.Linear``: ``style`` is "colwise" (split outputs) or "rowwise" (split inputs)."""
    if style not in ("colwise", "rowwise"):
        raise ValueError(f"unknown shard style {style!r}")
    shard_param_(linear, "weight", 0 if style == "colwise" else 1, rank, world)
    if linear.bias is not None and style == "colwise":
        shard_param_(linear, "bias", 0, rank, world)
    linear.in_features = linear.weight.shape[1]
    linear.out_features = linear.weight.shape[0]


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` (identity without a group)."""
    return x if group is None else funcol.all_reduce(x, "sum", group)


def all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dim (identity without a group)."""
    if group is None:
        return x
    world = dist.get_world_size(group)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch 2.11
    gathered = gather(x.contiguous(), 0, group)  # [world * d0, ...]
    return torch.cat(gathered.chunk(world, dim=0), dim=-1)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over ranks; out-of-shard ids give zeros, then all_reduce."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.vocab = vocab
        self.start = 0
        self.group: Group = None

    def shard_(self, group: Group) -> None:
        rank, world = world_of(group)
        check_divisible("the vocabulary", self.vocab, world)
        shard_param_(self, "weight", 0, rank, world)
        self.start = rank * (self.vocab // world)
        self.group = group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, D]
        if self.group is None:
            return nn.functional.embedding(tokens, self.weight)
        local = tokens - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(out * inside.unsqueeze(-1).to(out.dtype), self.group)
