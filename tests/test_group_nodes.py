"""Tier 2: all_reduces whose group is an FX node (``compile_on_one_rank``: in
``torch.compiler.config`` since torch 2.14, ``torch.distributed.config`` in 2.13 (a deprecated alias since);
fake process group).

Compiled on one rank for all, a collective's group is resolved at run time from the device
mesh the graph takes as an input: ``group_name = mesh_get_process_group(mesh, dim)``. Every
such all_reduce used to be left alone ("is not a resolved group name"). Two of them over one
mesh input's same dimension share their group on whatever rank runs the graph: they are
keyed by that (``collectives.group_identity``) and a collective replacing them passes the
same group node. A group the graph computes any other way is still left alone, saying so.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from graphs import GraphBuilder

import fxcoalesce
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.collectives import ALL_REDUCE, MESH_GROUP, WAIT, find_comm_blocks, group_of

ONE_RANK_CONFIG = next((c for c in (torch.compiler.config, getattr(dist, "config", None))
                        if hasattr(c, "compile_on_one_rank")), None)
"""Where this torch keeps ``compile_on_one_rank`` (2.14 moved it; the old name is a deprecated alias)."""
pytestmark = pytest.mark.skipif(ONE_RANK_CONFIG is None,
                                reason="compile_on_one_rank is new in torch 2.13")


def compile_on_one_rank(fn, *args, **config):
    """(outputs, eager outputs, the rewritten graph, its report) of ``fn`` compiled with the
    group resolved at run time (``config``: more ``Config`` fields)."""
    graphs = []
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager", strict=True, **config),
                            on_graph=lambda b, a, r: graphs.append((a, r)))
    torch._dynamo.reset()
    with ONE_RANK_CONFIG.patch(compile_on_one_rank=True):
        out = torch.compile(fn, backend=be, fullgraph=True)(*args)
        want = fn(*args)
    ((after, report),) = graphs
    return out, tuple(funcol.wait_tensor(t) for t in want), after, report


def mesh_of(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    init_fake_group(int(torch.Size(shape).numel()))
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def test_a_sum_over_one_mesh_dimension_becomes_one_all_reduce():
    mesh = mesh_of((2,), ("tp",))

    def f(x, y):
        return (funcol.all_reduce(x * 2, "sum", mesh) + funcol.all_reduce(y * 3, "sum", mesh),)

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out, want, after, report = compile_on_one_rank(f, x, y)
    a = report.all_reduce
    # 2 -> 1, neither left alone; the new all_reduce reads the mesh's group node
    assert (a["before"], a["after"], a["left_alone"], a["bytes_after"]) == (2, 1, 0, 128)
    (ar,) = after.graph.find_nodes(op="call_function", target=ALL_REDUCE)
    assert str(ar.args[2].target) == MESH_GROUP
    # the issue sequence names the group it resolved to, so ranks can compare it
    assert group_of(ar) == mesh.get_group("tp").group_name
    torch.testing.assert_close(out, want)


def test_dtensor_partial_sums_compiled_on_one_rank_become_one_all_reduce():
    """DTensor's redistribute (Partial -> Replicate) under compile_on_one_rank: the group is
    a mesh node and ``to_local`` leaves a view after each wait; both are seen through."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = mesh_of((2,), ("tp",))

    def reduced(t):
        return DTensor.from_local(t, mesh, [Partial()]).redistribute(
            mesh, [Replicate()]).to_local()

    def f(x, y):
        return (reduced(x * 2) + reduced(y * 3),)

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out, want, _, report = compile_on_one_rank(f, x, y)
    assert [b["kind"] for b in report.buckets] == ["sum"]
    assert (report.all_reduce["after"], report.all_reduce["left_alone"]) == (1, 0)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("run_checks", [False, True])
def test_dimensions_of_a_mesh_are_different_groups(run_checks):
    mesh = mesh_of((2, 2), ("dp", "tp"))

    def f(x, y, z):
        summed = funcol.all_reduce(x * 2, "sum", (mesh, 0)) + funcol.all_reduce(
            y * 3, "sum", (mesh, 1))
        return summed, funcol.all_reduce(z * 4, "sum", (mesh, 1))

    x, y, z = (torch.randn(4, 8) for _ in range(3))
    out, want, _, report = compile_on_one_rank(f, x, y, z, run_checks=run_checks)
    torch.testing.assert_close(out, want)
    if run_checks:
        # tp's first all_reduce carries the run-time tag, paired element for element with
        # the program's first all_reduce of tp: it stays out of the bucket (one launch above
        # the bound, said in a warning and the verdict)
        assert report.buckets == [] and report.all_reduce["after"] == 3
        assert any("stays out of its bucket" in w for w in report.warnings)
        assert "kept apart for the run-time check" in report.verdict
        return
    # dp's all_reduce is not summed with tp's; tp's two independent ones share one bucket
    assert [(b["kind"], len(b["members"])) for b in report.buckets] == [("cat", 2)]
    assert (report.all_reduce["after"], report.all_reduce["left_alone"]) == (2, 0)


def test_a_group_computed_otherwise_is_left_alone_saying_why():
    b = GraphBuilder()
    x, groups = b.input("x", (4, 4)), b.graph.placeholder("groups")
    group = b.graph.call_function(operator.getitem, (groups, 0))    # picked at run time
    ar = b.graph.call_function(ALL_REDUCE, (b.add(x, x), "sum", group))
    ar.meta["val"] = x.meta["val"]
    wait = b.graph.call_function(WAIT, (ar,))
    wait.meta["val"] = x.meta["val"]
    scan = find_comm_blocks(b.build(wait).graph)
    assert scan.blocks == [] and [why for _, why in scan.skipped] == [
        "group getitem is computed at run time by <built-in function getitem>: which "
        "all_reduces share it is unknown"]
