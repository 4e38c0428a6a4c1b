"""Which ATen ops keep a token split: asked of DTensor's sharding rules, not a table of ours.

A split of the tokens into parts is a ``Shard(dim)`` placement on a mesh of two: an op keeps
the split where DTensor runs it on the parts with no communication and the output sharded
again. DTensor's propagator answers that for every op it has a rule for (elementwise ops,
``mm`` against a replicated weight, a ``mean`` over the hidden dim, views, ``cat`` on
another dim, ``embedding``); a reduction over the tokens comes out ``Partial``, a softmax or
``cumsum`` over them asks for ``Replicate``, and an op it has no rule for (attention kernels,
custom ops) raises: the three ways a split ends.

    keeps(node, {x: 1})          for  %y = mul(%x, %cos)  with x [1, 64, 2, 8], cos [64, 1, 8]
      -> Kept(out=(1,), wants={cos: 0})   y is split on dim 1; cos must be sliced on dim 0

Sizes are read with their hints (a symbolic token count keeps its rules at any size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from fxcoalesce.meta import size_hint

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Kept:
    """An op that keeps the split: its outputs' token dims, and the inputs taken whole so far
    that must be split too (``Replicate`` -> ``Shard(dim)``: a slice, no communication)."""

    out: tuple[int, ...]
    wants: dict[Node, int]


@functools.cache
def _mesh():
    """A mesh of two ranks that no process group backs: the propagator only reads its size."""
    from torch.distributed.device_mesh import DeviceMesh

    with _disable_current_modes():  # made outside the graph's fake mode, whatever is active
        return DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)


def available() -> str | None:
    """None when DTensor's propagator can be asked here, else why not."""
    try:
        from torch.distributed.tensor._api import DTensor  # noqa: F401

        _mesh()
    except Exception as e:  # noqa: BLE001 - any torch build without it
        return f"DTensor's sharding rules are not available here ({type(e).__name__}: {e})"
    return None


def _spec(val: torch.Tensor, dim: int | None):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import Replicate, Shard

    shape = torch.Size(size_hint(s) for s in val.shape)
    stride = tuple(size_hint(s) for s in val.stride())
    placement = Replicate() if dim is None else Shard(dim)
    return DTensorSpec(_mesh(), (placement,), TensorMeta(shape, stride, val.dtype))


def _dims(spec) -> int | None | str:
    """Shard(d) -> d, Replicate -> None, anything else (Partial) -> "other"."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    (p,) = spec.placements
    return p.dim if isinstance(p, Shard) else None if isinstance(p, Replicate) else "other"


def keeps(node: Node, dims: dict[Node, int]) -> Kept | None:
    """Does ``node`` keep the split when its inputs in ``dims`` are split on those dims and
    every other tensor input is whole? None when it does not or DTensor cannot tell."""
    target = node.target
    if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
            or target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags):
        return None  # mutations (cache writes) and random ops never split
    from torch.distributed.tensor._api import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    nodes: list[Node] = []

    def spec_of(a):
        if not isinstance(a, Node):
            return a
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            nodes.append(a)
            return _spec(val, dims.get(a))
        if isinstance(val, (int, torch.SymInt)):
            return size_hint(val)
        raise _Unknown

    try:
        args, kwargs = tree_map(spec_of, (node.args, node.kwargs))
    except _Unknown:
        return None
    prop = DTensor._op_dispatcher.sharding_propagator
    schema = OpSchema(target, args, kwargs, schema_info=prop.op_to_schema_info.get(target))
    try:
        with _disable_current_modes():
            result = prop.propagate_op_sharding(schema)
    except Exception:  # noqa: BLE001 - no rule for this op, or a rule that rejects it
        return None
    outs = [s for s in tree_leaves(result.output_spec) if isinstance(s, DTensorSpec)]
    out = tuple(_dims(s) for s in outs)
    if not out or not all(isinstance(d, int) for d in out):
        return None  # Partial (a reduction over the tokens) or whole (tokens mixed)
    wants: dict[Node, int] = {}
    if result.redistribute_schema is not None:
        asked = [s for s in tree_leaves((result.redistribute_schema.args_schema,
                                         result.redistribute_schema.kwargs_schema))
                 if isinstance(s, DTensorSpec)]
        if len(asked) != len(nodes):
            return None
        for a, spec in zip(nodes, asked):
            want, have = _dims(spec), dims.get(a)
            if want == have:
                continue
            if have is None and isinstance(want, int) and wants.get(a, want) == want:
                wants[a] = want  # a whole input to be sliced: no communication
                continue
            return None  # a split input taken whole or re-split: the tokens mix
    return Kept(out, wants)


class _Unknown(Exception):
    """An argument the propagator cannot be given (a node of no tensor or size value)."""


def output_vals(node: Node) -> list[torch.Tensor]:
    """The tensor outputs of ``node`` in order (one for most ops; ``unbind`` has several)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
        return list(val)
    return []


__all__ = ["Kept", "available", "keeps", "output_vals"]
