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

from dataclasses import dataclass

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


def analyze(gm: GraphModule | torch.fx.Graph, scan: CommScan | None = None) -> Analysis:
    """Levels, windows and the lower bound for every all_reduce of ``gm`` (linear time).

    Reads ATen graphs (what AOTAutograd hands a backend) and Dynamo-level graphs alike.
    """
    graph = gm.graph if isinstance(gm, GraphModule) else gm
    scan = scan or find_comm_blocks(graph)
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
