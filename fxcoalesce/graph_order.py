"""Stable topological reordering of an FX graph that keeps one collective issue order.

Rewrites insert nodes next to an anchor and may leave a consumer before its new producer;
:func:`reorder` restores a valid order while moving as little as possible: among the nodes
whose inputs are ready it always emits the one with the smallest priority (by default its
current position). Side-effecting nodes (see ``analysis.is_barrier``) keep their place
relative to everything else.

Collectives are chained so that they come out in one fixed *issue order*, whatever the
priorities say. Ranks match collectives by issue order, and a rank's priorities come from
where its compute sits, which can differ between ranks (a bias added on rank 0 only). The
issue order is the collectives' current order, or, after a rewrite merged some of them,
:func:`issue_order`: a topological order of the collectives alone, ties broken by a
rank-invariant key (the program position of the first original collective a node stands
for). Both depend only on which collectives depend on which, never on compute placement.
"""

from __future__ import annotations

import heapq
import itertools

from torch.fx import Graph, Node

from .collectives import is_collective


def _edges(nodes: list[Node], barriers) -> tuple[dict[Node, list[Node]], dict[Node, int]]:
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
    return succ, indeg


def _kahn(nodes: list[Node], succ, indeg, key) -> list[Node]:
    """Topological order emitting, among ready nodes, the one with the smallest ``key``."""
    indeg = dict(indeg)
    pos = {n: i for i, n in enumerate(nodes)}
    heap = [(key(n), pos[n]) for n in nodes if indeg[n] == 0]
    heapq.heapify(heap)
    emitted = []
    while heap:
        _, i = heapq.heappop(heap)
        n = nodes[i]
        emitted.append(n)
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (key(s), pos[s]))
    if len(emitted) != len(nodes):
        raise RuntimeError(f"graph has a cycle: {len(nodes) - len(emitted)} nodes unreachable")
    return emitted


def issue_order(nodes: list[Node], succ, indeg, issue_keys: dict[Node, float]) -> list[Node]:
    """The collectives of ``nodes`` in a rank-invariant order.

    Kahn's algorithm that runs every ready non-collective first and, when only collectives
    are ready, the one with the smallest ``issue_keys`` entry. A collective is then ready
    exactly when the collectives it depends on have run, so the order is a function of the
    collective-to-collective dependencies and the keys alone.
    """
    missing = [n.name for n in nodes if is_collective(n) and n not in issue_keys]
    if missing:
        raise ValueError(f"no issue key for collective(s) {missing}")
    order = _kahn(nodes, succ, indeg,
                  lambda n: (1, issue_keys[n]) if is_collective(n) else (0, 0))
    return [n for n in order if is_collective(n)]


def reorder(graph: Graph, priority: dict[Node, float] | None = None,
            barriers: set[Node] | frozenset = frozenset(),
            issue_keys: dict[Node, float] | None = None) -> list[Node]:
    """Reorder ``graph`` in place into a topological order that follows ``priority`` and
    issues the collectives in their current order (``issue_keys=None``) or in
    :func:`issue_order` of ``issue_keys``. Returns the collectives in issue order.

    Raises ``RuntimeError`` if the graph has a cycle (a rewrite bug: callers fall back).
    """
    nodes = [n for n in graph.nodes if n.op != "output"]
    output = graph.output_node()
    pos = {n: i for i, n in enumerate(nodes)}
    prio = dict(priority or {})
    for i, n in enumerate(nodes):  # placeholders stay first, in their order
        if n.op == "placeholder":
            prio[n] = -1e18 + i
    key = lambda n: prio.get(n, pos[n])  # noqa: E731
    current = [n for n in nodes if is_collective(n)]
    if issue_keys is None and _sorted(nodes, pos, key):
        return current  # what Kahn's algorithm below makes of it: the order it has
    succ, indeg = _edges(nodes, barriers)
    if issue_keys is None:
        collectives = current
    else:
        collectives = issue_order(nodes, succ, indeg, issue_keys)
        if collectives == current and _sorted(nodes, pos, key):
            return collectives
    for a, b in itertools.pairwise(collectives):
        succ[a].append(b)
        indeg[b] += 1
    for n in _kahn(nodes, succ, indeg, key):
        output.prepend(n)
    return collectives


def _sorted(nodes: list[Node], pos: dict[Node, int], key) -> bool:
    """Does every node come after its inputs, and do the keys never decrease along
    ``nodes``? Then :func:`_kahn` emits ``nodes`` as they are, when the collectives keep
    their order too: every node is ready once the nodes before it are (barriers and the
    collective chain follow the current order), and among the nodes not yet emitted it has
    the smallest (key, position)."""
    last = None
    for i, n in enumerate(nodes):
        k = key(n)
        if last is not None and k < last:
            return False
        last = k
        for j in n.all_input_nodes:
            if pos[j] >= i:
                return False
    return True


def pin_order(gm) -> int:
    """Make each node marked with ``meta.RUN_AFTER`` depend on the marked nodes through
    Inductor's own ``control_deps`` (what its overlap scheduler pins collectives with), so
    that the generated code keeps a staggered order: Inductor otherwise issues a collective
    right before its wait and fuses the two parts' norms into one kernel, which waits for
    both all_reduces. Marks naming nodes a later pass replaced are dropped; on a torch
    whose Inductor cannot compile ``control_deps`` (``torch_releases.CONTROL_DEPS_FROM``)
    nothing is pinned. Returns the nodes pinned. Run last, on the
    graph Inductor compiles."""
    from .meta import RUN_AFTER

    graph = gm.graph
    named = {n.name: n for n in graph.nodes}
    marks = {}
    for n in graph.nodes:
        deps = n.meta.pop(RUN_AFTER, None)
        if n.op == "call_function" and deps and set(deps) <= named.keys():
            marks[n] = [named[d] for d in deps]
    from .torch_releases import CONTROL_DEPS_FROM, torch_version

    if not marks or torch_version() < CONTROL_DEPS_FROM:
        return 0
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet
    except ImportError:
        return 0
    from .analysis import is_barrier

    preserve_node_ordering(graph, {n: OrderedSet(d) for n, d in marks.items()})
    # each pinned node sits before what it now depends on: the least moves that fix that
    owned = {n for n in graph.nodes if is_collective(n)}
    reorder(graph, None, {n for n in graph.nodes if is_barrier(n, owned)})
    return len(marks)
