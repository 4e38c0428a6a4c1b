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
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(reg)}")
    return reg[name]


def args_of(name: str, layers: int | None = None):
    """The config of model ``name``, with ``layers`` overriding its depth (the config's own
    checks apply: ValueError when that depth does not make a valid model)."""
    args = family_of(name).CONFIGS[name]
    if layers is None:
        return args
    if layers < 1:
        raise ValueError("the layer count must be at least 1")
    return dataclasses.replace(args, n_layers=layers)


def build(name: str, *, hand_merged: bool = False, dtype: torch.dtype = torch.float32,
          device=None, seed: int = 0, layers: int | None = None) -> torch.nn.Module:
    """The unsharded model ``name`` with seeded weights (``layers`` overrides its depth)."""
    return family_of(name).build(args_of(name, layers), hand_merged=hand_merged, dtype=dtype,
                                 device=device, seed=seed)


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
