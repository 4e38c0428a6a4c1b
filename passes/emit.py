"""How a pass adds nodes: one emitter, and one way to give new nodes a place in the order.

    emit = Emitter(graph, before=root)            # or after=anchor: each node after the last
    s = emit(aten.add.Tensor, p, q)               # meta["val"] from the inputs' fake values
    w = emit(WAIT, emit(ALL_REDUCE, s, "sum", group))
    place(priority, emit.new, after=priority[p])  # right after p, in emission order

Where a node is inserted only has to be valid for FX; where it ends up is what
``graph_order.reorder`` makes of the priorities (original nodes: their position).
"""

from __future__ import annotations

from torch.fx import Graph, Node

from fxcoalesce.meta import propagate_val


class Emitter:
    """Inserts ``call_function`` nodes at one place of ``graph``, in order, each with its fake
    ``meta["val"]``; ``new`` lists them as emitted."""

    def __init__(self, graph: Graph, *, before: Node | None = None, after: Node | None = None,
                 mode=None):
        if (before is None) == (after is None):
            raise ValueError("give exactly one of before= and after=")
        self.graph, self.before, self.cursor, self.mode = graph, before, after, mode
        self.new: list[Node] = []

    def __call__(self, target, *args, **kwargs) -> Node:
        if self.before is not None:
            with self.graph.inserting_before(self.before):
                node = self.graph.call_function(target, args, kwargs)
        else:
            with self.graph.inserting_after(self.cursor):
                node = self.cursor = self.graph.call_function(target, args, kwargs)
        propagate_val(node, self.mode)
        self.new.append(node)
        return node


def place(priority: dict[Node, float], nodes: list[Node], *, after: float) -> None:
    """Priorities for ``nodes``, in their order, strictly between ``after`` and ``after + 1``:
    right after the node of priority ``after``, before the original node that follows it."""
    for j, n in enumerate(nodes):
        priority[n] = after + (j + 1) / (len(nodes) + 1)
