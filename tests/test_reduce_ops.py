"""Tiers 1 and 2: a reduce op given as ``dist.ReduceOp`` instead of the string "sum".

Torch 2.15 accepts ``funcol.all_reduce(x, dist.ReduceOp.SUM, group)`` (2.13 and 2.14 raise
on it), and Dynamo breaks the graph at every such call: the report of the graph before the
break says where, and what to write instead. A graph that holds the enum (built by hand:
``make_fx`` cannot trace it either) is read like one that holds "sum".
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from graphs import GraphBuilder

import fxcoalesce
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.collectives import describe, find_comm_blocks
from fxcoalesce.reduce_ops import reduce_op_name

TAKES_THE_ENUM = torch.ops._c10d_functional.all_reduce.default._schema.arguments[1].type \
    .kind() != "StringType"
"""Whether this torch's functional all_reduce takes ``dist.ReduceOp`` (2.15: ``Any``)."""
needs_enum = pytest.mark.skipif(not TAKES_THE_ENUM, reason=f"torch {torch.__version__}'s "
                                "functional all_reduce takes only a string reduce op")


def test_reduce_op_names():
    assert [reduce_op_name(op) for op in ("sum", "SUM", dist.ReduceOp.SUM, dist.ReduceOp.AVG,
                                          dist.ReduceOp(dist.ReduceOp.MAX))] == \
        ["sum", "sum", "sum", "avg", "max"]


@needs_enum
def test_an_enum_in_a_graph_is_read_like_the_string():
    """An FX graph can hold the enum only when built by hand (make_fx raises on it, and FX
    cannot print it as Python: no GraphModule); its analysis keys it as "sum"."""
    read = []
    for op in (dist.ReduceOp.SUM, "sum"):
        b = GraphBuilder()
        x, y = b.input("x"), b.input("y")
        b.add(b.all_reduce(b.mm(x, x), op=op), b.all_reduce(b.mm(y, y), op=op))
        scan = find_comm_blocks(b.graph)
        read.append(([blk.key for blk in scan.blocks], [describe(n) for n in scan.sequence]))
    assert read[0] == read[1]
    assert [k.op for k in read[0][0]] == ["sum", "sum"]


@needs_enum
def test_a_dynamo_break_at_an_enum_all_reduce_is_reported():
    """Regression (torch 2.15): Dynamo broke the graph at each all_reduce given the enum, the
    reports said 0 -> 0 and no word of why."""
    group = init_fake_group(2)

    def f(x, y):
        a = funcol.all_reduce(x * 2, dist.ReduceOp.SUM, group)  # the line the warning names
        return a + funcol.all_reduce(y * 3, "sum", group)

    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(f, backend="fxcoalesce")(x, y), f(x, y))
    line = f.__code__.co_firstlineno + 1
    warned = [w for r in fxcoalesce.reports() for w in r.warnings if "dist.ReduceOp" in w]
    assert len(warned) == 1, [r.warnings for r in fxcoalesce.reports()]
    assert f"{__file__}:{line}" in warned[0]
    assert 'funcol.all_reduce(x, "sum", group)' in warned[0]
    (first,) = [r for r in fxcoalesce.reports() if any("dist.ReduceOp" in w for w in r.warnings)]
    assert 'write the reduce op as a string' in first.summary()


def test_the_string_reduce_op_makes_no_such_warning():
    group = init_fake_group(2)

    def f(x, y):
        return funcol.all_reduce(x * 2, "sum", group) + funcol.all_reduce(y * 3, "sum", group)

    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    torch.compile(f, backend="fxcoalesce", fullgraph=True)(torch.randn(4, 8), torch.randn(4, 8))
    (report,) = fxcoalesce.reports()
    assert report.all_reduce["after"] == 1
    assert not any("ReduceOp" in w for w in report.warnings)
