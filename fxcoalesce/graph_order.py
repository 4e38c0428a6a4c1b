"""Stable topological reordering of an FX graph.

Rewrites insert nodes next to an anchor and may leave a consumer before its new producer;
:func:`reorder` restores a valid order while moving as little as possible: among the nodes
whose inputs are ready it always emits the one with the smallest priority (by default its
current position). Side-effecting nodes (see ``analysis.is_barrier``) keep their place
relative to everything else.
"""

from __future__ import annotations

import heapq

from torch.fx import Graph, Node


def reorder(graph: Graph, priority: dict[Node, float] | None = None,
            barriers: set[Node] | frozenset = frozenset()) -> None:
    """Reorder ``graph`` in place into a topological order that follows ``priority``.

    Raises ``RuntimeError`` if the graph has a cycle (a rewrite bug: callers fall back).
    """
    nodes = [n for n in graph.nodes if n.op != "output"]
    output = next(iter(reversed(graph.nodes)))
    pos = {n: i for i, n in enumerate(nodes)}
    prio = dict(priority or {})
    for i, n in enumerate(nodes):  # placeholders stay first, in their order
        if n.op == "placeholder":
            prio[n] = -1e18 + i
    succ: dict[Node, list[Node]] = {n: [] for n in nodes}
    indeg = dict.fromkeys(nodes, 0)

    def edge(a: Node, b: Node) -> None:
        succ[a].append(b)
        indeg[b] += 1

    for n in nodes:
        for i in dict.fromkeys(n.all_input_nodes):
            edge(i, n)
    segment: list[Node] = []
    last_barrier = None
    for n in nodes:  # a barrier follows its whole segment and precedes the next one
        if n in barriers:
            for m in segment:
                edge(m, n)
            segment, last_barrier = [], n
        else:
            if last_barrier is not None:
                edge(last_barrier, n)
            segment.append(n)

    heap = [(prio.get(n, pos[n]), pos[n], n.name) for n in nodes if indeg[n] == 0]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(heap)
    emitted = []
    while heap:
        _, _, name = heapq.heappop(heap)
        n = by_name[name]
        emitted.append(n)
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (prio.get(s, pos[s]), pos[s], s.name))
    if len(emitted) != len(nodes):
        raise RuntimeError(f"graph has a cycle: {len(nodes) - len(emitted)} nodes unreachable")
    for n in emitted:
        output.prepend(n)
