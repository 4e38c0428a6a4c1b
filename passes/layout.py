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
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from fxcoalesce.meta import (numel, propagate_val, same_shape, size_hint, tensor_val,
                             tensor_vals)

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


def layout_source(node: Node) -> Node | None:
    """The tensor a layout-only op (``RESHAPES``, ``SAME_VALUE``) takes its elements from, or
    None if ``node`` is not one."""
    return _source(node)


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


def output_strides(graph) -> list[tuple | None]:
    """The strides of each graph output, in output order (None where it is not a tensor)."""
    (out,) = graph.find_nodes(op="output")
    return [tuple(v.stride()) if (v := tensor_val(leaf)) is not None else None
            for leaf in tree_leaves(out.args)]


def refresh_vals(changed: Node, mode) -> None:
    """Recompute ``meta["val"]`` downstream of ``changed``, whose value now has another layout,
    as far as layouts change: a view of it, or an op whose output follows its input's strides
    (elementwise ops), would keep stale strides otherwise."""
    position = {n: i for i, n in enumerate(changed.graph.nodes)}
    todo = {u: position[u] for u in changed.users}
    while todo:
        node = min(todo, key=todo.__getitem__)
        del todo[node]
        if node.op != "call_function":
            continue
        before = [_layout(v) for v in tensor_vals(node)]
        propagate_val(node, mode)
        if any(not same_shape(a, b) for a, b in zip(before, map(_layout, tensor_vals(node)))):
            todo.update({u: position[u] for u in node.users})


def _layout(v: torch.Tensor) -> tuple:
    return (*v.shape, -1, *v.stride(), -1, v.storage_offset())


def restorable(shape, stride) -> bool:
    """Whether :func:`keep_output_strides` can lay a tensor of ``shape`` out with ``stride``
    again: its elements overlap at most along expanded dims (stride 0). False when unsure."""
    extent = 0
    for size, st in sorted(((z, s) for z, s in zip(shape, stride) if not _known(z == 1)
                            and not _known(s == 0)), key=lambda p: size_hint(p[1])):
        if not _known(st > extent):
            return False
        extent = extent + (size - 1) * st
    return True


def _known(b) -> bool:
    return statically_known_true(b)


def keep_output_strides(graph, before: list[tuple | None], mode) -> list[Node]:
    """Give every graph output whose strides differ from ``before`` (``output_strides`` of the
    graph before a rewrite, each :func:`restorable`) those strides back: a functional
    ``copy`` of it into an ``empty_strided`` buffer laid out as before (of size 1 along
    expanded dims, then ``as_strided`` to the whole shape). Inductor lowers the copy to one
    write of the elements and lays a non-view output, and the input of an ``as_strided``, out
    exactly as its ``meta["val"]`` says; the empty buffer itself is never allocated. Returns
    the new nodes."""
    (out,) = graph.find_nodes(op="output")
    leaves, spec = tree_flatten(out.args)
    emit = Emitter(graph, before=out, mode=mode)
    for i, (leaf, stride) in enumerate(zip(leaves, before, strict=True)):
        v = tensor_val(leaf)
        if stride is None or v is None or same_shape(tuple(v.stride()), stride):
            continue
        shape = list(v.shape)
        expanded = [d for d, (z, s) in enumerate(zip(shape, stride))
                    if _known(s == 0) and not _known(z == 1)]
        part = leaf
        for d in expanded:
            part = emit(aten.slice.Tensor, part, d, 0, 1)
        base = [1 if d in expanded else z for d, z in enumerate(shape)]
        like = emit(aten.empty_strided.default, base, list(stride), dtype=v.dtype,
                    device=v.device)
        leaves[i] = emit(aten.copy.default, like, part)
        if expanded:
            leaves[i] = emit(aten.as_strided.default, leaves[i], shape, list(stride), 0)
    out.args = tree_unflatten(leaves, spec)
    return emit.new
