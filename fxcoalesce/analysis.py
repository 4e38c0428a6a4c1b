"""Dependency analysis of the all_reduces in a graph, in one linear walk.

The *level* of an all_reduce is the number of all_reduces (of its key) on the longest
dependency chain ending at it. All_reduces of one key and one level are mutually
independent, so each level can be one launch; the longest chain is a lower bound on launches
(Mirsky). Side-effecting nodes are barriers: everything after one depends on everything
before it, so no merge ever crosses one.

    x ─ AR1 ─┬─ AR2 ─ AR3        levels: AR1 1, AR2 2, AR4 2, AR3 3   → bound 3 launches
             └─ AR4
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from .collectives import WAIT, CommBlock, CommScan, Key, find_comm_blocks, op_of


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """Analysis facts about one comm block."""

    block: CommBlock
    level: int
    """Longest chain of same-key all_reduces ending here (1 = depends on none)."""
    global_level: int
    """Longest chain of all_reduces of any key ending here."""
    ready: int
    """Node index of the collective's input: the earliest it can be issued."""
    need: int
    """Node index of the first consumer of its wait: the latest it can complete."""

    @property
    def slack(self) -> int:
        """Nodes between ready and need that could overlap the collective."""
        return max(self.need - self.ready - 1, 0)


@dataclass(slots=True)
class Analysis:
    """What :func:`analyze` finds; plain data that the passes and the report consume."""

    scan: CommScan
    infos: list[BlockInfo]
    order: dict[Node, int]
    barriers: list[Node]
    chains: dict[Key, int]
    """Longest chain per key."""
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """What is computed from this analysis alone, kept with it (``cost.compute_prefix``
    per roofline): an analysis reused for an unchanged graph brings its predictions."""

    @property
    def lower_bound(self) -> int:
        """Fewest launches any exact rewrite can reach for the analysed all_reduces (the
        left-alone ones, ``scan.skipped``, are not in it)."""
        return sum(self.chains.values())

    @property
    def all_reduce_count(self) -> int:
        """All all_reduces of the graph, analysed or left alone."""
        return self.scan.all_reduce_count

    @property
    def analysed_count(self) -> int:
        return len(self.infos)

    @property
    def at_bound(self) -> bool:
        return self.analysed_count == self.lower_bound

    def levels(self) -> dict[str, int]:
        return {i.block.collective.name: i.level for i in self.infos}


def is_barrier(node: Node, blocks: set[Node]) -> bool:
    """Side-effecting ops (mutable schema, except the all_reduce_ blocks we own)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target._schema.is_mutable
        and node not in blocks
    )


def _vmax(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return a if a == b else tuple(x if x >= y else y for x, y in zip(a, b))


_CACHE: ContextVar[dict | None] = ContextVar("fxcoalesce_analysis_cache", default=None)


@contextlib.contextmanager
def analysis_cache():
    """Within it, :func:`analyze` of a graph that has not changed since its last analysis
    returns that analysis again (the pipeline: each pass analyses the graph it is given, and
    most passes leave it as it was). Unchanged means :func:`graph_state` is the same: the
    same nodes in the same order, each with the same op, target, arguments and value."""
    token = _CACHE.set({})
    try:
        yield
    finally:
        _CACHE.reset(token)


def graph_state(graph: torch.fx.Graph) -> tuple[list, list[int]]:
    """What :func:`analyze` reads of ``graph``, by identity: every node in order with its op,
    target, args, kwargs (FX makes a new tuple and dict on every update) and fake value;
    with their ids. The state holds the objects, so that no id of theirs is reused while it
    lives: comparing the ids of two states (``same_state``) compares the objects."""
    objects = []
    for n in graph.nodes:
        meta = n.meta
        objects += (n, n.op, n.target, n._args, n._kwargs,
                    meta["val"] if "val" in meta else meta.get("example_value"))
    return objects, list(map(id, objects))


def same_state(a: tuple[list, list[int]], b: tuple[list, list[int]]) -> bool:
    return a[1] == b[1]


def remember(graph: torch.fx.Graph, analysis: Analysis) -> None:
    """Keep ``analysis`` as ``graph``'s (inside :func:`analysis_cache`; else nothing)."""
    cache = _CACHE.get()
    if cache is not None:
        cache[id(graph)] = (graph, graph_state(graph), analysis)


def remapped(analysis: Analysis, nodes: dict[Node, Node]) -> Analysis:
    """``analysis`` of a graph, read for a node-for-node copy of it (``nodes``: original ->
    copy, every node, output included): what :func:`analyze` of the copy finds."""
    blocks = {b: dataclasses.replace(
        b, collective=nodes[b.collective], wait=nodes[b.wait], input=nodes[b.input],
        copy_back=None if b.copy_back is None else nodes[b.copy_back])
        for b in analysis.scan.blocks}
    s = analysis.scan
    scan = CommScan(blocks=[blocks[b] for b in s.blocks],
                    skipped=[(nodes[n], why) for n, why in s.skipped], other=dict(s.other),
                    unknown=[(nodes[n], why) for n, why in s.unknown],
                    sequence=[nodes[n] for n in s.sequence])
    infos = [dataclasses.replace(i, block=blocks[i.block]) for i in analysis.infos]
    return Analysis(scan, infos, {nodes[n]: i for n, i in analysis.order.items()},
                    [nodes[n] for n in analysis.barriers], dict(analysis.chains))


def analyze(gm: GraphModule | torch.fx.Graph, scan: CommScan | None = None) -> Analysis:
    """Levels, windows and the lower bound for every all_reduce of ``gm`` (linear time).

    Reads ATen graphs (what AOTAutograd hands a backend) and Dynamo-level graphs alike.
    Inside :func:`analysis_cache`, an unchanged graph's analysis is returned again.
    """
    graph = gm.graph if isinstance(gm, GraphModule) else gm
    cache = _CACHE.get()
    if scan is None and cache is not None:
        state = graph_state(graph)
        entry = cache.get(id(graph))
        if entry is not None and entry[0] is graph and same_state(entry[1], state):
            return entry[2]
        found = _analyze(graph, find_comm_blocks(graph))
        cache[id(graph)] = (graph, state, found)
        return found
    return _analyze(graph, scan or find_comm_blocks(graph))


def _analyze(graph: torch.fx.Graph, scan: CommScan) -> Analysis:
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    keys = list(dict.fromkeys(b.key for b in scan.blocks))
    kidx = {k: i for i, k in enumerate(keys)}
    by_coll = {b.collective: b for b in scan.blocks}
    by_wait = {b.wait: b for b in scan.blocks}
    width = len(keys) + 1  # last slot counts all keys together

    zero = (0,) * width
    depth: dict[Node, tuple[int, ...]] = {}
    running, fence = zero, zero
    levels: dict[CommBlock, tuple[int, int]] = {}
    barriers = []
    barrier_set: set[Node] = set()
    for n in nodes:
        d = fence
        for i in n.all_input_nodes:
            d = _vmax(d, depth[i])
        # a collective left alone that mutates its input (all_reduce_ of a view) is a
        # barrier, and so is its wait: the mutation lands there, and nothing that reads the
        # mutated storage may be issued before it
        if is_barrier(n, by_coll.keys()) or (op_of(n) is WAIT and n.args[0] in barrier_set):
            barrier_set.add(n)
            barriers.append(n)
            d = fence = _vmax(running, d)
        elif n in by_wait:
            b = by_wait[n]
            k = kidx[b.key]
            lvl, glvl = d[k] + 1, d[-1] + 1
            levels[b] = (lvl, glvl)
            d = tuple(lvl if j == k else glvl if j == width - 1 else x for j, x in enumerate(d))
        depth[n] = d
        running = _vmax(running, d)

    infos = []
    for b in scan.blocks:
        lvl, glvl = levels[b]
        need = min((order[u] for u in b.wait.users), default=len(nodes))
        infos.append(BlockInfo(b, lvl, glvl, order[b.input], need))
    chains: dict[Key, int] = {}
    for i in infos:
        chains[i.block.key] = max(chains.get(i.block.key, 0), i.level)
    return Analysis(scan, infos, order, barriers, chains)
