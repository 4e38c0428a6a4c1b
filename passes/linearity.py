"""linearity: a sum of all_reduces becomes the all_reduce of the sum.

Requires: ``cfg.reassociate`` (the partial sums are added before the reduction instead of
after it, which changes floating-point rounding; with ``reassociate=False`` the pass leaves
the graph alone). Ensures: in every tree of adds, subtractions and scalings whose leaves
include two or more all_reduces with one key (same group, same op, sum or avg, same dtype)
read with one shape, each through its wait directly or through layout-only ops after it
(``passes.layout``: view, reshape, unsqueeze, a copy back, ...) that nothing else reads,
those all_reduces become one, of the combined partial sums, each partial put through its
own wait's layout ops: one launch instead of several, and the bytes of one. Parallel
attention + MLP blocks and shared + routed experts then match the engines' hand merge in
launches and bytes.

    before                                    after
    %wa = wait(all_reduce(%p, sum, 0))        %pv = reshape(%p, [1, 6, 64])
    %va = view(%wa, [1, 6, 64])               %s  = add(%pv, %q)
    %wb = wait(all_reduce(%q, sum, 0))        %w  = wait(all_reduce(%s, sum, 0))
    %h  = add(%x, %va)                        %o  = add(%x, %w)
    %o  = add(%h, %wb)

Never fires when a wait or one of its layout ops has another consumer, when dtypes, groups,
ops or the shapes read differ (broadcasting could make the sum larger than any member), for
ops other than sum and avg (both linear), or through a scaling by anything but a Python
number (a tensor factor might differ between ranks). The new all_reduce takes the issue
place of the first one it replaces (rank-invariant, see ``graph_order``).
"""

from __future__ import annotations


import torch
from torch.fx import GraphModule, Node

from fxcoalesce.analysis import analyze
from fxcoalesce.collectives import ALL_REDUCE, WAIT, CommBlock
from fxcoalesce.config import Config
from fxcoalesce.graph_order import reorder
from fxcoalesce.meta import (ORIGIN, REPLACES, fake_mode_of, hinted_nbytes, is_scalar, origin,
                             replaced, same_shape, tensor_val)

from .decide import Decider
from .emit import Emitter, place
from .layout import LayoutChain, layout_chain, replay
from .result import Bucket, PassResult

aten = torch.ops.aten
LINEAR_OPS = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)
LINEAR_REDUCTIONS = ("sum", "avg")


def _dtype(node) -> torch.dtype | None:
    val = tensor_val(node)
    return val.dtype if val is not None else None


def _children(node: Node) -> list[tuple[object, float]] | None:
    """The terms ``node`` adds up, with their coefficients, or None if it is not linear."""
    if node.op != "call_function" or node.target not in LINEAR_OPS or len(node.args) != 2:
        return None
    a, b = node.args
    alpha = node.kwargs.get("alpha", 1)
    if set(node.kwargs) - {"alpha"} or not is_scalar(alpha):
        return None
    if node.target is aten.add.Tensor and isinstance(a, Node) and isinstance(b, Node):
        return [(a, 1), (b, alpha)]
    if node.target is aten.sub.Tensor and isinstance(a, Node) and isinstance(b, Node):
        return [(a, 1), (b, -alpha)]
    if node.target is aten.mul.Tensor and isinstance(a, Node) and is_scalar(b):
        return [(a, b)]
    if node.target is aten.mul.Tensor and is_scalar(a) and isinstance(b, Node):
        return [(b, a)]
    if node.target is aten.div.Tensor and isinstance(a, Node) and is_scalar(b) and b != 0:
        return [(a, 1 / b)]
    return None


def expand(root: Node) -> tuple[list[Node], dict[Node, float]]:
    """(internal nodes, leaf -> coefficient): ``root`` as a linear combination of leaves.

    A linear node is expanded into its operands when it is the root or has exactly one user
    (its parent in the tree) and the root's dtype, so erasing the tree loses nothing.
    """
    internal: list[Node] = []
    leaves: dict[Node, float] = {}
    dtype = _dtype(root)

    def visit(node: Node, coeff: float, is_root: bool) -> None:
        terms = _children(node)
        single = is_root or (len(node.users) == 1 and _dtype(node) == dtype)
        if terms is None or not single:
            leaves[node] = leaves.get(node, 0) + coeff
            return
        internal.append(node)
        for child, c in terms:
            visit(child, coeff * c, False)

    visit(root, 1, True)
    return internal, leaves


def _is_root(node: Node) -> bool:
    """A linear node that no other linear node of the same dtype absorbs as its only user."""
    if _children(node) is None:
        return False
    if len(node.users) != 1:
        return True
    (user,) = node.users
    return _children(user) is None or _dtype(user) != _dtype(node)


Member = tuple[CommBlock, LayoutChain]
"""An all_reduce a tree reads, and the layout-only ops between its wait and the tree."""


def _reducible(block: CommBlock, chain: LayoutChain, tree_dtype) -> bool:
    return (block.impl == "nccl" and block.key.op in LINEAR_REDUCTIONS and not block.inplace
            and len(chain.end.users) == 1 and block.key.dtype == tree_dtype)


def _groups(members: list[Member]) -> list[list[Member]]:
    """Members that may become one all_reduce: one key, and values of one shape, so that
    their partials line up element for element on every rank (no broadcasting, which could
    also make the sum larger than any member)."""
    groups: list[list[Member]] = []
    for m in members:
        shape = tensor_val(m[1].end).shape
        for g in groups:
            if g[0][0].key == m[0].key and same_shape(tensor_val(g[0][1].end).shape, shape):
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


def _chosen(decider: Decider, info_of: dict, group: list[Member], result: PassResult
            ) -> list[Member]:
    """The members of one group that the cost model merges (one member's bytes)."""
    chosen, record = decider.choose([info_of[b] for b, _ in group],
                                    lambda sub: max(m.block.nbytes for m in sub))
    result.decisions.append(record)
    blocks = {m.block for m in chosen}
    return [m for m in group if m[0] in blocks]


def linearity_pass(gm: GraphModule, *, cfg: Config) -> PassResult:
    result = PassResult()
    if not cfg.reassociate:
        return result
    analysis = analyze(gm)
    # each all_reduce as the node a tree of adds would read it through: its wait's chain
    members = {}
    for b in analysis.scan.blocks:
        chain = layout_chain(b.wait, analysis.order)
        members[chain.end] = (b, chain)
    info_of = {i.block: i for i in analysis.infos}
    decider = Decider.of(analysis, cfg)
    graph = gm.graph
    mode = fake_mode_of(analysis.order)
    priority = {n: float(i) for n, i in analysis.order.items()}
    issue_keys = {n: float(i) for i, n in enumerate(analysis.scan.sequence)}
    for root in [n for n in graph.nodes if _is_root(n)]:
        internal, leaves = expand(root)
        found = [members[leaf] for leaf, coeff in leaves.items() if leaf in members
                 and coeff != 0 and _reducible(*members[leaf], _dtype(root))]
        groups = [_chosen(decider, info_of, g, result) for g in _groups(found) if len(g) > 1]
        groups = [g for g in groups if len(g) > 1]
        if not groups:
            continue
        emit = Emitter(graph, before=root, mode=mode)
        reduced = []
        for group in groups:
            start = len(emit.new)
            # each partial through its own layout ops: they line up as the waits' values do
            # inputs as they are now (``b.input`` is the analysis's: an earlier root's sum,
            # replaced in this loop, may be one: a chain of sums of sums)
            partial = combination(emit, [(replay(emit, b.collective.args[0], chain),
                                          leaves[chain.end]) for b, chain in group])
            blocks = [b for b, _ in group]
            key = blocks[0].key
            fused = emit(ALL_REDUCE, partial, key.op, blocks[0].group)
            fused.meta[REPLACES] = replaced(b.collective for b in blocks)
            # the coefficients too: a scale one rank alone applies must not be summed across
            fused.meta[ORIGIN] = "sum({})".format(",".join(
                origin(b.collective) if leaves[chain.end] == 1 else
                f"{leaves[chain.end]!r}*{origin(b.collective)}" for b, chain in group))
            # issued as soon as its last partial is ready; waited for where the root was
            place(priority, emit.new[start:],
                  after=max(priority[b.collective.args[0]] for b in blocks))
            reduced.append(emit(WAIT, fused))
            issue_keys[fused] = float(min(b.ordinal for b in blocks))
            result.buckets.append(Bucket(
                members=[b.collective.name for b in blocks],
                level=max(info_of[b].level for b in blocks),
                key=str(key), nbytes=hinted_nbytes(fused.meta["val"]),
                collective=fused.name,
                kind="sum"))
        merged = {chain.end for group in groups for _, chain in group}
        rest = [(leaf, c) for leaf, c in leaves.items() if leaf not in merged and c != 0]
        value = combination(emit, rest + [(w, 1) for w in reduced])
        place(priority, [n for n in emit.new if n not in priority], after=priority[root] - 1)
        root.replace_all_uses_with(value)
        for n in internal:  # root first: each is erased after its only user
            graph.erase_node(n)
        for group in groups:
            for b, chain in group:
                for n in (*reversed(chain.ops), b.wait, b.collective):
                    graph.erase_node(n)
    if result.buckets:
        reorder(graph, priority, set(analysis.barriers), issue_keys)
        result.changed = True
    return result
