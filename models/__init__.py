"""Tensor-parallel model zoo: named configs, one build function, one apply_tp.

Each family module (``transformer``, ``deepseek``, ``llama``) has ``CONFIGS``, ``build(name, ...)``,
``apply_tp(model, group)`` and ``check_tp(args, world)`` (the sizes ``apply_tp`` must split
evenly). Models import only torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import torch

FAMILIES = ("transformer", "deepseek", "llama")


def _family_modules() -> list[ModuleType]:
    return [importlib.import_module(f".{f}", __name__) for f in FAMILIES]


def registry() -> dict[str, ModuleType]:
    """Model name → the family module that builds it."""
    return {name: fam for fam in _family_modules() for name in fam.CONFIGS}


def model_names() -> list[str]:
    return list(registry())


def family_of(name: str) -> ModuleType:
    reg = registry()
    if name not in reg:
        import difflib  # (models import torch only: docs/layout.md)

        close = difflib.get_close_matches(name, list(reg), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown model {name!r}; {hint}choose one of: {', '.join(reg)}")
    return reg[name]


def args_of(name: str, layers: int | None = None, dim: int | None = None):
    """The config of model ``name``, with ``layers`` overriding its depth and ``dim`` its
    hidden size (MLP widths scale with it; dense attention keeps its head size, so its head
    counts scale too). The config's own checks apply: ValueError when that does not make a
    valid model."""
    args = family_of(name).CONFIGS[name]
    if layers is not None:
        if layers < 1:
            raise ValueError("the layer count must be at least 1")
        args = dataclasses.replace(args, n_layers=layers)
    if dim is None or dim == args.dim:
        return args
    if dim < 1:
        raise ValueError("the hidden size must be at least 1")
    scaled = {f: getattr(args, f) * dim // args.dim for f in ("inter_dim", "moe_inter_dim")
              if hasattr(args, f)}
    if hasattr(args, "head_dim") and not hasattr(args, "kv_lora_rank"):  # dense attention
        if dim % args.head_dim or (args.n_heads * dim) % (args.dim * args.n_kv_heads):
            raise ValueError(f"a hidden size of {dim} does not keep {name}'s head size "
                             f"({args.head_dim}) and its heads per KV head")
        scaled.update(n_heads=args.n_heads * dim // args.dim,
                      n_kv_heads=max(1, args.n_kv_heads * dim // args.dim))
    return dataclasses.replace(args, dim=dim, **scaled)


def build(name: str, *, hand_merged: bool = False, dtype: torch.dtype = torch.float32,
          device=None, seed: int = 0, layers: int | None = None, dim: int | None = None
          ) -> torch.nn.Module:
    """The unsharded model ``name`` with seeded weights (``layers`` overrides its depth,
    ``dim`` its hidden size: :func:`args_of`)."""
    return family_of(name).build(args_of(name, layers, dim), hand_merged=hand_merged,
                                 dtype=dtype, device=device, seed=seed)


def parameter_count(name: str, layers: int | None = None) -> int:
    """Parameters of the unsharded model ``name`` (counted on the meta device: no memory)."""
    with torch.device("meta"):
        model = family_of(name).Transformer(args_of(name, layers))
    return sum(p.numel() for p in model.parameters())


def apply_tp(model: torch.nn.Module, group, *, keep_collectives: bool = False
             ) -> torch.nn.Module:
    """Shard ``model`` over ``group`` in place (its family's ``apply_tp``). A group of one rank
    shards nothing; ``keep_collectives=True`` keeps its (no-op) all_reduces in the graph, so
    that one GPU can measure and lower them."""
    fam = importlib.import_module(type(model).__module__)
    return fam.apply_tp(model, group, keep_collectives=keep_collectives)


def check_tp(name: str, world: int) -> None:
    """Raise ValueError when ``world`` ranks cannot shard ``name`` (``apply_tp``'s own checks),
    without building it: tools reject a bad TP degree before spawning ranks."""
    fam = family_of(name)
    fam.check_tp(fam.CONFIGS[name], world)
