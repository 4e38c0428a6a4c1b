"""Layout-only ops between a wait and its consumer, which linearity and slice see through.

An op here moves no element: read in row-major order, its output is its input (``view``,
``_unsafe_view``, ``reshape``, ``unsqueeze``, ``squeeze``, ``flatten``, ``unflatten``, an
``expand`` that keeps the element count, and the value-preserving ``alias``, ``clone`` and
functional ``copy`` into a same-shape buffer, which is how AOTAutograd writes an in-place
``dist.all_reduce(t)`` back into ``t``). An all_reduce combines ranks element by element in
that order, so such an op commutes with it, for every reduce op and whatever the op's
arguments are on the other ranks (which one rank's graph cannot see):

    f(wait(all_reduce(x))) == wait(all_reduce(f(x)))

Index maps that reorder or select (``permute``, ``transpose``, ``slice``, ``select``) commute
only when every rank passes the same arguments; they are not seen through (the slice pass
reduces a selection and has its arguments compared across ranks when the graph compiles:
``agreement``).

    %w = wait(all_reduce(%p))        layout_chain(%w, order).ops == [%c, %v]
    %c = copy(%p, %w)                replay(emit, %q, chain) == reshape(%q, [1, 6, 64])
    %v = view(%c, [1, 6, 64])        (the copy is dropped: its value is its source's)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxcoalesce.meta import numel, same_shape, tensor_val

from .emit import Emitter

aten = torch.ops.aten
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
            aten.flatten.using_ints, aten.unflatten.int, aten.expand.default}
"""Ops whose output, read in row-major order, is their input (``expand``: when it keeps the
element count)."""
SAME_VALUE = {aten.alias.default, aten.clone.default, aten.copy.default}
"""Ops whose output equals their input (``copy(dst, src)``: src, when dst is shaped like it)."""
VIEWS = {aten.view.default, aten._unsafe_view.default}
"""Replayed as ``reshape``: the tensor they are replayed on may not be viewable."""


@dataclass(frozen=True, slots=True)
class LayoutChain:
    """Layout-only ops after a wait, each the only user of the one before."""

    wait: Node
    ops: tuple[Node, ...]

    @property
    def end(self) -> Node:
        """What the consumer reads: the last op, or the wait itself."""
        return self.ops[-1] if self.ops else self.wait


def _source(node: Node) -> Node | None:
    """The tensor a layout-only op takes its elements from, or None if ``node`` is not one."""
    if node.op != "call_function" or node.target not in RESHAPES | SAME_VALUE:
        return None
    if node.target is aten.copy.default:
        dst, src = node.args[:2]
        a, b = tensor_val(dst), tensor_val(src)
        same = (a is not None and b is not None and a.dtype == b.dtype
                and a.device == b.device and same_shape(a.shape, b.shape))
        return src if same and len(node.args) == 2 and not node.kwargs else None
    src = node.args[0]
    if node.target is aten.expand.default:
        a, b = tensor_val(src), tensor_val(node)
        if a is None or b is None or not statically_known_true(
                numel(a.shape) == numel(b.shape)):
            return None
    return src if isinstance(src, Node) else None


def layout_chain(wait: Node, order: dict[Node, int]) -> LayoutChain:
    """The longest chain of layout-only ops from ``wait``: each reads the one before as its
    source and is its only user, and every other node it reads (a size, a copy's
    destination) is in ``order`` before the collective, so that the chain can be replayed
    on the collective's input."""
    issue = order[wait.args[0]]
    ops: list[Node] = []
    node = wait
    while len(node.users) == 1:
        (user,) = node.users
        others = [n for n in user.all_input_nodes if n is not node]
        if _source(user) is not node or any(order.get(n, issue) >= issue for n in others):
            break
        ops.append(user)
        node = user
    return LayoutChain(wait, tuple(ops))


def replay(emit: Emitter, x: Node, chain: LayoutChain) -> Node:
    """``chain``'s ops applied to ``x`` (shaped like the chain's wait) instead: what the chain
    makes of an all_reduce's result, made of its input. Ops that change nothing are left
    out."""
    for op in chain.ops:
        before = tensor_val(x)
        if op.target in SAME_VALUE or same_shape(before.shape, tensor_val(op).shape):
            continue
        target = aten.reshape.default if op.target in VIEWS else op.target
        x = emit(target, x, *op.args[1:], **op.kwargs)
    return x
