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


PREMUL = torch._C._distributed_c10d._make_nccl_premul_sum
"""``premul_sum`` with a factor: the all_reduce multiplies each rank's input by it, then sums.
Torch 2.15's functional all_reduce takes it (its reduce_op is ``Any``, pytorch#190942)."""


def test_reduce_ops_are_identified_by_type():
    from fxcoalesce.reduce_ops import plain_reduce_op, summable

    assert [plain_reduce_op(op) for op in ("sum", "AVG", "max", dist.ReduceOp.SUM,
                                           dist.ReduceOp(dist.ReduceOp.AVG),
                                           dist.ReduceOp.MIN)] == \
        ["sum", "avg", "max", "sum", "avg", "min"]
    for op in (PREMUL(0.5), dist.ReduceOp.PREMUL_SUM, "premul_sum", "median", 0, None,
               object()):
        assert plain_reduce_op(op) is None, op
    assert [summable(op) for op in ("sum", dist.ReduceOp.AVG, "max", PREMUL(2.0))] == \
        [True, True, False, False]


def premul_graph(op):
    """Three all_reduces with reduce op ``op``: two summed (what the linearity pass merges),
    one beside them (what the bucket pass joins). Built node by node: the op cannot be
    fake-run where the schema takes a string (2.13), nor printed as Python (no GraphModule
    code: a lazy one, as the pipeline makes)."""
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    from fxcoalesce.collectives import ALL_REDUCE

    b = GraphBuilder()
    x, y, w = b.input("x", (4, 8)), b.input("y", (4, 8)), b.input("w", (8, 8))

    def all_reduce(v):
        node = b.graph.call_function(ALL_REDUCE, (v, op, "0"))
        node.meta["val"] = v.meta["val"]
        return b.wait(node)

    b.graph.output((b.add(all_reduce(b.add(x, x)), all_reduce(b.add(y, y))),
                    all_reduce(b.mm(x, w))))
    with _use_lazy_graph_module(True):
        return _make_graph_module(torch.nn.Module(), b.graph)


def test_a_premul_sum_with_a_factor_stays_as_it_is():
    """Regression: the bucket pass joined three premul_sum(0.5) all_reduces into one
    all_reduce of the string "premul_sum", the factor gone."""
    from fxcoalesce import Config, run_pipeline
    from fxcoalesce.collectives import ALL_REDUCE

    op = PREMUL(0.5)
    cfg = Config(strict=True, run_checks=False)  # a fake group may be up: no first one pinned
    out, report = run_pipeline(premul_graph(op), cfg)
    kept = [n for n in out.graph.nodes if n.target is ALL_REDUCE]
    assert len(kept) == 3 and all(n.args[1] is op for n in kept)
    assert report.all_reduce["after"] == 3 and report.all_reduce["left_alone"] == 3
    assert "reduce op premul_sum carries a factor its name does not" in " ".join(report.warnings)
    # the same graph with "sum": summed and bucketed, 3 -> 1
    out, report = run_pipeline(premul_graph("sum"), cfg)
    assert report.all_reduce["after"] == 1
