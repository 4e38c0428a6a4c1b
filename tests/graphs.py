"""Build ATen FX graphs by hand, with fake ``meta["val"]`` and no process group.

    b = GraphBuilder()
    x, w = b.input("x", (4, 8)), b.input("w", (8, 8))
    h = b.all_reduce(b.mm(x, w))           # all_reduce + wait_tensor, returns the wait
    gm = b.build(b.add(h, x))

The functional collectives have fake kernels, so they trace under ``FakeTensorMode`` without
any group. To *run* a graph, :func:`substitute_collectives` turns every all_reduce into
``mul(x, 2)``: elementwise, so it commutes with cat/split and bucketing must keep values exact.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic, ShapeEnv, StatelessSymbolicContext,
)
from torch.utils._pytree import tree_map

from fxcoalesce.collectives import ALL_REDUCE, ALL_REDUCE_, WAIT
from fxcoalesce.meta import propagate_val

aten = torch.ops.aten


class GraphBuilder:
    """A ``torch.fx.Graph`` under construction; every node gets its fake ``meta["val"]``."""

    def __init__(self, *, dynamic: bool = False):
        self.graph = Graph()
        self.mode = FakeTensorMode(shape_env=ShapeEnv() if dynamic else None)

    def input(self, name: str, shape=(4, 4), dtype=torch.float32, *, dynamic=False) -> Node:
        """A placeholder; ``dynamic=True`` gives every size a SymInt (builder must be dynamic)."""
        node = self.graph.placeholder(name)
        if dynamic:
            ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
            node.meta["val"] = self.mode.from_tensor(torch.empty(shape, dtype=dtype),
                                                     symbolic_context=ctx)
        else:
            with self.mode:
                node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def input_like(self, name: str, val: torch.Tensor) -> Node:
        """A placeholder whose fake value has ``val``'s shape, strides and dtype (a value that
        crosses a graph break: an output of one graph, an input of the next)."""
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty_strided(tuple(val.shape), tuple(val.stride()),
                                                   dtype=val.dtype)
        return node

    def call(self, target, *args, **kwargs) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        propagate_val(node, self.mode)
        return node

    def mm(self, a: Node, b: Node) -> Node:
        return self.call(aten.mm.default, a, b)

    def add(self, a: Node, b: Node) -> Node:
        return self.call(aten.add.Tensor, a, b)

    def collective(self, x: Node, group="0", op="sum", inplace=False) -> Node:
        """The all_reduce node alone (no wait)."""
        return self.call(ALL_REDUCE_ if inplace else ALL_REDUCE, x, op, group)

    def wait(self, c: Node) -> Node:
        return self.call(WAIT, c)

    def all_reduce(self, x: Node, group="0", op="sum", inplace=False) -> Node:
        """all_reduce (or all_reduce_) of ``x`` and its wait_tensor; returns the wait."""
        return self.wait(self.collective(x, group, op, inplace))

    def build(self, *outputs: Node) -> GraphModule:
        self.graph.output(tuple(outputs))
        self.graph.lint()
        return GraphModule(torch.nn.Module(), self.graph)


def diamond() -> GraphModule:
    """x -> AR1 -> {AR2, AR3} -> add -> AR4: 4 launches, bound 3 (AR2 and AR3 share level 2)."""
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    w1 = b.all_reduce(b.mm(x, w))
    w2 = b.all_reduce(b.mm(w1, w))
    w3 = b.all_reduce(b.add(w1, x))
    return b.build(b.all_reduce(b.add(w2, w3)))


def calls(gm: GraphModule, target) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def all_reduces(gm: GraphModule) -> list[Node]:
    return calls(gm, ALL_REDUCE) + calls(gm, ALL_REDUCE_)


def ops(gm: GraphModule) -> list[str]:
    """Node order as short names: "placeholder", "mm.default", "getitem", "output"."""
    return [getattr(n.target, "__name__", n.target) if n.op == "call_function" else n.op
            for n in gm.graph.nodes]


def position(gm: GraphModule) -> dict[str, int]:
    """Node name -> index in node order."""
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def stale_vals(gm: GraphModule) -> list[str]:
    """Nodes whose ``meta["val"]`` differs (shape, dtype, strides) from what their op gives on
    their inputs' values: a rewrite must leave none."""
    mode = next(n.meta["val"].fake_mode for n in gm.graph.find_nodes(op="placeholder"))
    stale = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a,
                                (n.args, n.kwargs))
        with mode:
            want = n.target(*args, **kwargs)
        got = n.meta["val"]
        if (str(want.shape), want.dtype, str(want.stride())) != (
                str(got.shape), got.dtype, str(got.stride())):
            stale.append(n.name)
    return stale


def substitute_collectives(gm: GraphModule) -> GraphModule:
    """A runnable copy of ``gm``: all_reduce(x) -> mul(x, 2) (mul_ in place), waits dropped."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in list(graph.nodes):
        if n.target is ALL_REDUCE or n.target is ALL_REDUCE_:
            n.target = aten.mul.Tensor if n.target is ALL_REDUCE else aten.mul_.Tensor
            n.args = (n.args[0], 2)
        elif n.target is WAIT:
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    graph.lint()
    return GraphModule(torch.nn.Module(), graph)


def real_inputs(gm: GraphModule, seed: int = 0) -> list[torch.Tensor]:
    """Random real tensors shaped like the placeholders' fake values."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in gm.graph.find_nodes(op="placeholder"):
        val = n.meta["val"]
        out.append(torch.randn(tuple(val.shape), generator=gen).to(val.dtype))
    return out


def run(gm: GraphModule, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Outputs of ``gm`` on clones of ``inputs`` (with all_reduce -> mul 2)."""
    return tuple(substitute_collectives(gm)(*[t.clone() for t in inputs]))
