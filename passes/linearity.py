"""linearity: the reduction moves past what is linear, so one all_reduce replaces several.

Requires: ``cfg.reassociate`` (the partial sums are added before the reduction instead of
after it, which changes floating-point rounding; with ``reassociate=False`` the pass leaves
the graph alone). An all_reduce of op sum or avg is linear in what it reduces, so every map
``L`` that is linear and applied alike on every rank commutes with it, and sums of such
terms combine:

    L(AR(x)) == AR(L(x))          c1 * L1(AR(a)) + c2 * L2(AR(b)) == AR(c1 * L1(a) + c2 * L2(b))

Ensures: each all_reduce is read through its *linear chain*: the ops after its wait, each the
only user of the one before, that are a linear map of that value alone, with arguments the
graph itself holds (so every rank's are in its issue sequence, below): the layout-only ops
(``passes.layout``: view, reshape, unsqueeze, a copy back, ...), ``sum`` and ``mean`` over
dimensions, ``permute``, ``transpose``, ``t``, and a scaling (``neg``, ``mul`` or ``div`` by a
Python number or by a one-element constant the graph makes: ``scalar_tensor``, ``full``, a
``get_attr``), in the value's own dtype and never broadcasting it larger. In every tree of
adds, subtractions, scalings, negations, functional copies (``out.add_(y)``, functionalized:
``add`` and a ``copy`` back) and sums over the dimension of a stack (``stack``, or as
Inductor's decompositions write it: ``view(cat(...))``, ``cat`` of ``unsqueeze``) whose leaves
include two or more chain ends of all_reduces with one key (same group, same op, sum or avg,
same dtype) and one shape, those all_reduces become one, of the combined partials, each
partial put through its own chain (layout ops as reshapes). A chain that shrinks its value (a
sum or mean over dimensions) is moved past alone too: ``sum_d(AR(x))`` becomes
``AR(sum_d(x))``. The pass runs again (``ROUNDS``) while it changes the graph: a sum's new
all_reduce read through a map by a later tree (``(AR(a) + AR(b)).t() + AR(c).t()``) joins it.
One launch instead of several, and the bytes of the smallest value read. Parallel attention
+ MLP blocks and shared + routed experts then match the engines' hand merge in launches and
bytes; Llama-4's MoE (transformers), whose routed experts' all_reduce is read as
``routed.reshape(k, n, d).sum(0)`` and added in place into the shared expert's:

    before                                        after
    %wr = wait(all_reduce(%r, sum, 0))   [k*n, d]  %rk = reshape(%r, [k, n, d])
    %vr = view(copy(%r, %wr), [k, n, d])           %rs = sum(%rk, [0])
    %sr = sum(%vr, [0])                  [n, d]    %p  = add(%s, %rs)
    %ws = wait(all_reduce(%s, sum, 0))   [n, d]    %w  = wait(all_reduce(%p, sum, 0))  [n, d]
    %o  = add(copy(%s, %ws), %sr)                  %o' = %w

(two launches of (k + 1) n d elements -> one of n d). A root whose layout the rewrite would
change (a sum of permuted terms reads back contiguous) gets its strides back by a copy into
an ``empty_strided`` buffer laid out as before, so every later node sees what it saw.

Never fires when a wait or one of its chain's ops has another consumer, when dtypes, groups,
ops or the shapes read differ (broadcasting could make the sum larger than any member), for
ops other than sum and avg (max and min commute with no sum: ``max(a) + max(b)`` is not
``max(a + b)``), through a scaling by a tensor the graph does not make (a weight or an input
might differ between ranks), or an op whose other inputs come after the all_reduce. The
all_reduce that opens a rewritten graph's run-time check (``checked.pinned``) is moved past what
keeps its element count only. Arguments one rank's graph sees are compared across ranks, as
the slice pass's are: the new collective's origin (``meta.ORIGIN``, part of the issue
sequence the ranks agree on) names each member's maps with their input shapes and
arguments and its coefficient, ``sum(#3,sum[4, 6, 64]([0])(#2))``; a permute whose dims
differ between ranks makes the ranks' sequences differ, and every rank compiles without
this pass. The new all_reduce takes the issue place of the first one it replaces
(rank-invariant, see ``graph_order``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_leaves

from fxcoalesce.analysis import analyze
from fxcoalesce.collectives import ALL_REDUCE, WAIT, CommBlock, op_name
from fxcoalesce.config import Config
from fxcoalesce.graph_order import reorder
from fxcoalesce.meta import (ORIGIN, REPLACES, fake_mode_of, hinted_nbytes, hinted_numel,
                             is_scalar, numel, origin, replaced, same_shape, tensor_val)

from .decide import Decider
from .emit import Emitter, place
from .layout import RESHAPES, SAME_VALUE, VIEWS, layout_chain, layout_source, restorable
from .result import Bucket, PassResult
from fxcoalesce.checked import pinned as checked_pinned
from fxcoalesce.checked import pinned_blocks

aten = torch.ops.aten
LINEAR_REDUCTIONS = ("sum", "avg")
MAPS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.permute.default,
        aten.transpose.int, aten.t.default}
"""Linear maps of one tensor whose other arguments are ints (dims), read through after a
wait: what they do to the flat row-major buffer is fixed by their input's shape and those
ints, which the new collective's origin records."""
SCALINGS = {aten.mul.Tensor, aten.div.Tensor, aten.neg.default}
STACK_REDUCTIONS = {aten.sum.dim_IntList: 1, aten.mean.dim: -1}
"""``op(stack(ts, k), [k])`` (``_stacked``): the sum of ``ts`` (or their mean: coefficient
1/len)."""


def _dtype(node) -> torch.dtype | None:
    val = tensor_val(node)
    return val.dtype if val is not None else None


def _attr(gm: GraphModule | None, target: str):
    try:
        return operator.attrgetter(target)(gm) if gm is not None else None
    except AttributeError:
        return None


def constant(x, gm: GraphModule | None = None) -> float | None:
    """``x``'s value where every rank's graph spells it out: a Python number, or a
    one-element tensor the graph makes from one (``scalar_tensor``, ``full``, a lifted
    ``get_attr`` constant of ``gm``); None for anything else (a weight, an input: their
    values could differ between ranks unseen). Never a bool (it selects, it does not
    scale)."""
    if is_scalar(x):
        return x
    if not isinstance(x, Node):
        return None
    if x.op == "get_attr":
        t = _attr(gm, x.target)
        if (isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor)
                and t.numel() == 1 and t.dtype.is_floating_point):
            return float(t.item())
        return None
    if x.op != "call_function":
        return None
    v = tensor_val(x)
    if v is None or v.dtype == torch.bool or not statically_known_true(v.numel() == 1):
        return None
    if x.target is aten.lift_fresh_copy.default:
        return constant(x.args[0], gm)
    if x.target is aten.scalar_tensor.default and is_scalar(x.args[0]):
        return x.args[0]
    if x.target is aten.full.default and len(x.args) == 2 and is_scalar(x.args[1]):
        return x.args[1]
    return None


def _static(args) -> bool:
    """Only ints, bools, None and dtypes: the same wherever the graph is the same."""
    return all(isinstance(a, (int, bool, torch.dtype)) or a is None for a in tree_leaves(args))


def _scaling(node: Node, gm) -> tuple[Node, float] | None:
    """(the tensor, the factor) when ``node`` scales one tensor by a constant without
    broadcasting it larger or changing its dtype."""
    if node.op != "call_function" or node.target not in SCALINGS:
        return None
    if node.target is aten.neg.default:
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], Node):
            return None
        return node.args[0], -1
    if len(node.args) != 2 or node.kwargs:
        return None
    x, c = node.args
    if node.target is aten.mul.Tensor and (not isinstance(x, Node) or (
            constant(x, gm) is not None and constant(c, gm) is None)):
        x, c = c, x                      # 2 * x
    k = constant(c, gm)
    if not isinstance(x, Node) or k is None or x is c:
        return None
    a, out = tensor_val(x), tensor_val(node)
    if a is None or out is None or a.dtype != out.dtype or not same_shape(a.shape, out.shape):
        return None
    if node.target is aten.div.Tensor:
        return (x, 1 / k) if k != 0 else None
    return x, k


def _map(node: Node, src: Node) -> bool:
    """Is ``node`` one of ``MAPS`` applied to ``src``, in its dtype, with int arguments?"""
    if node.op != "call_function" or node.target not in MAPS or not node.args:
        return False
    a, out = tensor_val(src), tensor_val(node)
    return (node.args[0] is src and _static((node.args[1:], node.kwargs)) and a is not None
            and out is not None and a.dtype == out.dtype)


def _linear_step(node: Node, src: Node, gm) -> bool:
    """Is ``node`` a linear map of ``src`` alone, the same on every rank whose graph is?"""
    if layout_source(node) is src or _map(node, src):
        return True
    s = _scaling(node, gm)
    return s is not None and s[0] is src


@dataclass(frozen=True, slots=True)
class Member:
    """An all_reduce and its linear chain: the ops after its wait, each a linear map of the
    one before and its only user (layout ops, ``MAPS``, scalings), ending where a tree of
    adds reads it."""

    block: CommBlock
    ops: tuple[Node, ...]

    @property
    def end(self) -> Node:
        return self.ops[-1] if self.ops else self.block.wait

    @property
    def shrinks(self) -> bool:
        """Does the chain end with fewer elements than the all_reduce reduces?"""
        return hinted_numel(tensor_val(self.end).shape) < hinted_numel(self.block.shape)

    def keeps_numel(self) -> bool:
        return statically_known_true(numel(tensor_val(self.end).shape) == self.block.numel)

    def maps(self) -> list[Node]:
        """The ops of the chain that are not layout-only: they enter the origin."""
        return [op for op in self.ops if layout_source(op) is None]


def linear_chain(block: CommBlock, order: dict[Node, int], gm) -> Member:
    """``block``'s :class:`Member`: its layout chain (``passes.layout``), then as long as
    each next op is a linear step of the one before, its only user, and reads nothing the
    graph computes after the collective; scalings at the end are left to the tree that
    reads them (as its coefficients)."""
    ops = list(layout_chain(block.wait, order).ops)
    issue = order[block.collective]
    node = ops[-1] if ops else block.wait
    while len(node.users) == 1:
        (user,) = node.users
        others = [n for n in user.all_input_nodes if n is not node]
        if not _linear_step(user, node, gm) or any(order.get(n, issue) >= issue
                                                  for n in others):
            break
        ops.append(user)
        node = user
    while ops and (layout_source(ops[-1]) is None and ops[-1].target in SCALINGS
                   or _call(ops[-1], {aten.unsqueeze.default}) and len(ops[-1].users) == 1
                   and _call(next(iter(ops[-1].users)), {aten.cat.default})):
        ops.pop()  # an unsqueeze into a cat stacks (``_stacked``): the tree reads its input
    return Member(block, tuple(ops))


def _call(node, targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _cat_dim(node: Node) -> int:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)


def _stacked(x: Node, dim: int) -> tuple[list[Node], list[Node]] | None:
    """(the tensors, the nodes that stack them) when ``x`` (read by nothing else) stacks
    tensors of one shape along ``dim``: ``stack(ts, dim)``, or as ``torch._refs.stack``
    (Inductor's decompositions) writes it, ``view(cat(ts, dim), sizes)`` with ``len(ts)``
    inserted into the sizes at ``dim``, or ``cat([unsqueeze(t, dim), ...], dim)``."""
    val = tensor_val(x)
    if len(x.users) != 1 or val is None:
        return None
    dim = dim % len(val.shape)
    if _call(x, {aten.stack.default}):
        k = _cat_dim(x)
        return (list(x.args[0]), [x]) if isinstance(k, int) and k % len(val.shape) == dim \
            else None
    if _call(x, {aten.cat.default}) and _cat_dim(x) % len(val.shape) == dim:
        parts = list(x.args[0])
        if all(_call(u, {aten.unsqueeze.default}) and len(u.users) == 1
               and u.args[1] % len(val.shape) == dim for u in parts):
            return [u.args[0] for u in parts], [x, *parts]
        return None
    cat = x.args[0] if _call(x, RESHAPES) and x.args else None
    if not (_call(cat, {aten.cat.default}) and len(cat.users) == 1):
        return None
    ts = list(cat.args[0])
    shapes = [tensor_val(t).shape if isinstance(t, Node) and tensor_val(t) is not None
              else None for t in ts]
    if any(v is None or not same_shape(v, shapes[0]) for v in shapes):
        return None
    sizes = list(shapes[0])
    k = _cat_dim(cat)
    if not isinstance(k, int) or dim >= len(sizes) or k % len(sizes) != dim:
        return None
    sizes.insert(dim, len(ts))
    return (ts, [x, cat]) if same_shape(val.shape, sizes) else None


def _stack_terms(node: Node) -> tuple[list[Node], float, list[Node]] | None:
    """(the stacked tensors, their coefficient, the nodes that stack them) when ``node`` is a
    sum or mean over exactly the dimension a stack of them added."""
    if node.target not in STACK_REDUCTIONS or len(node.args) != 2:
        return None
    st, dims = node.args
    if set(node.kwargs) - {"keepdim", "dtype"} or node.kwargs.get("keepdim", False) or (
            node.kwargs.get("dtype") not in (None, _dtype(node))):
        return None
    if not (isinstance(st, Node) and isinstance(dims, (list, tuple)) and len(dims) == 1
            and isinstance(dims[0], int)):
        return None
    found = _stacked(st, dims[0])
    if found is None or not all(isinstance(t, Node) and _dtype(t) == _dtype(node)
                                for t in found[0]):
        return None
    c = 1 if STACK_REDUCTIONS[node.target] == 1 else 1 / len(found[0])
    return found[0], c, found[1]


def _children(node: Node, gm=None) -> tuple[list[tuple[Node, float]], list[Node]] | None:
    """(the terms ``node`` adds up, with their coefficients; other nodes it reads that go
    with it: a stack), or None if it is not a linear node of a tree."""
    if node.op != "call_function":
        return None
    if node.target in STACK_REDUCTIONS:
        st = _stack_terms(node)
        return ([(t, st[1]) for t in st[0]], st[2]) if st is not None else None
    if node.target is aten.copy.default:  # a functional copy back (an in-place op's)
        if len(node.args) != 2 or node.kwargs:
            return None
        dst, src = node.args
        a, b = tensor_val(dst), tensor_val(src)
        if (isinstance(dst, Node) and isinstance(src, Node) and a is not None and b is not None
                and a.dtype == b.dtype and same_shape(a.shape, b.shape) and dst is not src):
            return [(src, 1)], []
        return None
    s = _scaling(node, gm)
    if s is not None:
        return [s], []
    if node.target not in (aten.add.Tensor, aten.sub.Tensor) or len(node.args) != 2:
        return None
    a, b = node.args
    alpha = node.kwargs.get("alpha", 1)
    if set(node.kwargs) - {"alpha"} or not is_scalar(alpha):
        return None
    if isinstance(a, Node) and isinstance(b, Node):
        return [(a, 1), (b, alpha if node.target is aten.add.Tensor else -alpha)], []
    return None


def expand(root: Node, members=(), gm=None) -> tuple[list[Node], dict[Node, float]]:
    """(internal nodes, leaf -> coefficient): ``root`` as a linear combination of leaves.

    A linear node is expanded into its operands when it is the root or has exactly one user
    (its parent in the tree) and the root's dtype, so erasing the tree loses nothing; an
    all_reduce's chain end (``members``) is a leaf. Internal nodes come root first, each
    after its only user.
    """
    internal: dict[Node, None] = {}
    leaves: dict[Node, float] = {}
    dtype = _dtype(root)

    def visit(node: Node, coeff: float, is_root: bool) -> None:
        terms = None if (node in members and not is_root) else _children(node, gm)
        single = is_root or (len(node.users) == 1 and _dtype(node) == dtype)
        if terms is None or not single:
            leaves[node] = leaves.get(node, 0) + coeff
            return
        internal[node] = None
        internal.update(dict.fromkeys(terms[1]))
        for child, c in terms[0]:
            visit(child, coeff * c, False)

    visit(root, 1, True)
    return list(internal), leaves


def _is_root(node: Node, gm=None) -> bool:
    """A linear node that no other linear node of the same dtype absorbs as its only user."""
    if _children(node, gm) is None:
        return False
    if len(node.users) != 1:
        return True
    (user,) = node.users
    return _children(user, gm) is None or _dtype(user) != _dtype(node)


def _reached(members: dict[Node, Member]) -> dict[Node, int]:
    """For each node, how many chain ends in ``members`` may be leaves of its tree (at least
    as many as :func:`expand` finds; a root below two is left out: it can sum nothing).

    A leaf's path up to its root runs through one of its users, then through nodes of one
    user each: the tree's internal nodes (:func:`expand` expands a node other than the root
    only when it has one user) and the nodes that stack a stack's terms (``_stacked``: each
    read by one node). So every root of a tree with that leaf is on the one-user chain from
    one of the leaf's users. Rewrites during a round only take leaves from later trees (a
    replaced root's value is no chain end, and is a leaf wherever the root was)."""
    reach: dict[Node, int] = {}
    for end in members:
        seen: set[Node] = set()
        for node in end.users:
            while node not in seen:
                seen.add(node)
                reach[node] = reach.get(node, 0) + 1
                if len(node.users) != 1:
                    break
                (node,) = node.users
    return reach


def _reducible(m: Member, tree_dtype, keep, *, alone: bool = False) -> bool:
    """May ``m`` be moved past its chain (``alone``: its end is replaced, whatever reads it),
    or into a sum (its end read by the tree alone)? ``keep`` (``checked.pinned``): only through a
    chain that keeps its element count."""
    b = m.block
    return (b.impl == "nccl" and b.key.op in LINEAR_REDUCTIONS and not b.inplace
            and (alone or len(m.end.users) == 1) and b.key.dtype == tree_dtype
            and (b not in keep or m.keeps_numel()))


def _groups(members: list[Member]) -> list[list[Member]]:
    """Members that may become one all_reduce: one key, and values of one shape, so that
    their partials line up element for element on every rank (no broadcasting, which could
    also make the sum larger than any member)."""
    groups: list[list[Member]] = []
    for m in members:
        shape = tensor_val(m.end).shape
        for g in groups:
            if g[0].block.key == m.block.key and same_shape(tensor_val(g[0].end).shape, shape):
                g.append(m)
                break
        else:
            groups.append([m])
    return groups


def combination(emit: Emitter, terms: list[tuple[Node, float]]) -> Node:
    """sum of coeff * node, with as few ops as the coefficients allow."""
    total = None
    for node, c in terms:
        if total is None:
            total = node if c == 1 else emit(aten.mul.Tensor, node, c)
        elif c == 1:
            total = emit(aten.add.Tensor, total, node)
        elif c == -1:
            total = emit(aten.sub.Tensor, total, node)
        else:
            total = emit(aten.add.Tensor, total, emit(aten.mul.Tensor, node, c))
    return total


def replay(emit: Emitter, x: Node, m: Member, gm=None) -> Node:
    """``m``'s chain applied to ``x`` (shaped like the wait) instead: what the chain makes of
    the all_reduce's result, made of its input. Layout ops that change nothing are left out,
    views become reshapes (``x`` may not be viewable), a scaling keeps its factor."""
    for op in m.ops:
        before = tensor_val(x)
        if layout_source(op) is not None:
            if op.target in SAME_VALUE or same_shape(before.shape, tensor_val(op).shape):
                continue
            target = aten.reshape.default if op.target in VIEWS else op.target
            x = emit(target, x, *op.args[1:], **op.kwargs)
        elif op.target in SCALINGS:
            src, _ = _scaling(op, gm)
            x = emit(op.target, *[x if a is src else a for a in op.args])
        else:
            x = emit(op.target, x, *op.args[1:], **op.kwargs)
    return x


def _shape(s) -> list:
    return [int(d) if isinstance(d, int) else str(d) for d in s]


def described(m: Member, coeff: float, gm=None) -> str:
    """What ``m`` puts into a sum, in the program's collectives: "#2", "0.5*#2",
    "sum[4, 6, 64]([0])(#2)" (each map with its input's shape and its arguments)."""
    text = origin(m.block.collective)
    for op in m.maps():
        if op.target in SCALINGS:
            text = f"{_scaling(op, gm)[1]!r}*{text}"
        else:
            args = ", ".join(map(str, (*op.args[1:], *op.kwargs.values())))
            text = f"{op_name(op)}{_shape(tensor_val(op.args[0]).shape)}({args})({text})"
    return text if coeff == 1 else f"{coeff!r}*{text}"


def _chosen(decider: Decider, info_of: dict, group: list[Member], result: PassResult
            ) -> list[Member]:
    """The members of one group that the cost model merges (the bytes of the value read)."""
    nbytes = hinted_nbytes(tensor_val(group[0].end))
    chosen, record = decider.choose([info_of[m.block] for m in group], lambda sub: nbytes)
    result.decisions.append(record)
    blocks = {m.block for m in chosen}
    return [m for m in group if m.block in blocks]


def _dense(v: torch.Tensor) -> bool:
    """Laid out without overlap or expanded dims: a copy into ``empty_strided`` gives it."""
    return restorable(v.shape, v.stride()) and not any(
        statically_known_true(s == 0) and not statically_known_true(z == 1)
        for z, s in zip(v.shape, v.stride()))


@dataclass(slots=True)
class _Rewrite:
    gm: GraphModule
    cfg: Config
    result: PassResult
    priority: dict
    issue_keys: dict
    info_of: dict
    mode: object
    erased: set = field(default_factory=set)

    def apply(self, root: Node, internal: list[Node], leaves: dict[Node, float],
              groups: list[list[Member]]) -> None:
        graph = self.gm.graph
        emit = Emitter(graph, before=root, mode=self.mode)
        reduced = []
        for group in groups:
            start = len(emit.new)
            # each partial through its own chain: they line up as the chains' values do;
            # inputs as they are now (``block.input`` is the analysis's: an earlier root's
            # sum, replaced in this loop, may be one: a chain of sums of sums)
            partial = combination(emit, [(replay(emit, m.block.collective.args[0], m, self.gm),
                                          leaves.get(m.end, 1)) for m in group])
            if not statically_known_true(tensor_val(partial).is_contiguous()):
                partial = emit(aten.clone.default, partial,
                               memory_format=torch.contiguous_format)
            blocks = [m.block for m in group]
            key = blocks[0].key
            fused = emit(ALL_REDUCE, partial, key.op, blocks[0].group)
            fused.meta[REPLACES] = replaced(b.collective for b in blocks)
            # the coefficients and maps too: a scale or a permute one rank alone applies
            # must not be summed across
            fused.meta[ORIGIN] = "sum({})".format(",".join(
                described(m, leaves.get(m.end, 1), self.gm) for m in group))
            # issued as soon as its last partial is ready; waited for where the root was
            place(self.priority, emit.new[start:],
                  after=max(self.priority[b.collective.args[0]] for b in blocks))
            reduced.append(emit(WAIT, fused))
            self.issue_keys[fused] = float(min(b.ordinal for b in blocks))
            self.result.buckets.append(Bucket(
                members=[b.collective.name for b in blocks],
                level=max(self.info_of[b].level for b in blocks),
                key=str(key), nbytes=hinted_nbytes(fused.meta["val"]),
                collective=fused.name,
                kind="sum"))
        merged = {m.end for group in groups for m in group}
        rest = [(leaf, c) for leaf, c in leaves.items() if leaf not in merged and c != 0]
        value = combination(emit, rest + [(w, 1) for w in reduced])
        want, got = tensor_val(root), tensor_val(value)
        if not same_shape(tuple(want.stride()), tuple(got.stride())):
            # the root's layout back (a sum of permuted terms reads back contiguous)
            like = emit(aten.empty_strided.default, list(want.shape), list(want.stride()),
                        dtype=want.dtype, device=want.device)
            value = emit(aten.copy.default, like, value)
        place(self.priority, [n for n in emit.new if n not in self.priority],
              after=self.priority[root] - 1)
        root.replace_all_uses_with(value)
        for n in internal:  # root first: each is erased after its only user
            graph.erase_node(n)
        for group in groups:
            for m in group:
                for n in (*reversed(m.ops), m.block.wait, m.block.collective):
                    graph.erase_node(n)
        self.erased.update(internal)
        self.erased.update(n for g in groups for m in g for n in m.ops)


ROUNDS = 4
"""Rounds at most: a sum's new all_reduce can be read through maps by a later tree
(``(AR(a) + AR(b)).t() + AR(c).t()``), which the next round sums."""


def linearity_pass(gm: GraphModule, *, cfg: Config, pinned: frozenset = frozenset()
                   ) -> PassResult:
    result = PassResult()
    if not cfg.reassociate:
        return result
    for _ in range(ROUNDS):
        done = _linearity_round(gm, cfg, pinned)
        result.buckets += done.buckets
        result.decisions += done.decisions
        if not done.changed:
            break
        result.changed = True
    return result


def _linearity_round(gm: GraphModule, cfg: Config, pinned: frozenset) -> PassResult:
    result = PassResult()
    analysis = analyze(gm)
    if pinned:  # an earlier round may have moved one past its chain: it keeps its pin
        pinned = checked_pinned(list(analysis.scan.sequence), True)
    keep = pinned_blocks(analysis.scan, pinned)
    # each all_reduce as the node a tree of adds reads it through: its chain's end
    members = {}
    for b in analysis.scan.blocks:
        m = linear_chain(b, analysis.order, gm)
        members[m.end] = m
    info_of = {i.block: i for i in analysis.infos}
    decider = Decider.of(analysis, cfg)
    rewrite = _Rewrite(gm, cfg, result, {n: float(i) for n, i in analysis.order.items()},
                       {n: float(i) for i, n in enumerate(analysis.scan.sequence)}, info_of,
                       fake_mode_of(analysis.order))
    done: set[Node] = set()  # chain ends rewritten
    reach = _reached(members)
    for root in [n for n in gm.graph.nodes if reach.get(n, 0) > 1 and _is_root(n, gm)]:
        if root in rewrite.erased or tensor_val(root) is None or not _dense(tensor_val(root)):
            continue
        internal, leaves = expand(root, members, gm)
        found = [members[leaf] for leaf, coeff in leaves.items() if leaf in members
                 and coeff != 0 and _reducible(members[leaf], _dtype(root), keep)]
        groups = [_chosen(decider, info_of, g, result) for g in _groups(found) if len(g) > 1]
        groups = [g for g in groups if len(g) > 1]
        if not groups:
            continue
        rewrite.apply(root, internal, leaves, groups)
        done.update(m.end for g in groups for m in g)
    # what is read through a sum over dimensions alone: the all_reduce of the smaller value
    for end, m in members.items():
        if (end in done or not m.shrinks or not _dense(tensor_val(end))
                or not _reducible(m, m.block.key.dtype, keep, alone=True)):
            continue
        rewrite.apply(end, [], {end: 1}, [[m]])
    if result.buckets:
        reorder(gm.graph, rewrite.priority, set(analysis.barriers), rewrite.issue_keys)
        result.changed = True
    return result
