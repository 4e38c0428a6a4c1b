"""Tier 1: collective recognition and level analysis on hand-built ATen graphs."""

from __future__ import annotations


import networkx as nx
import torch
from graphs import GraphBuilder, all_reduces, diamond, real_inputs, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule

from fxcoalesce import Config, analyze, find_comm_blocks, run_pipeline
from fxcoalesce.collectives import ALL_REDUCE, WAIT

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@torch.library.custom_op("fxcoalesce_test::all_reduce", mutates_args=())
def opaque_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """A collective that fxcoalesce cannot see into (like a vendor's custom all_reduce)."""
    return x.clone()


@opaque_all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


def chain(n: int) -> GraphModule:
    """Sequential residual: h = h + AR(h @ w), n times (every AR feeds the next)."""
    b = GraphBuilder()
    h, w = b.input("x"), b.input("w")
    for _ in range(n):
        h = b.add(h, b.all_reduce(b.mm(h, w)))
    return b.build(h)



def test_chain_levels_and_bound():
    a = analyze(chain(4))
    # each AR depends on the previous one: levels 1..4
    assert list(a.levels().values()) == [1, 2, 3, 4]
    # the bound equals the count: nothing to merge
    assert (a.lower_bound, a.all_reduce_count, a.at_bound) == (4, 4, True)


def test_ready_need_slack_exact():
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")                   # 0, 1
    a = b.mm(x, w)                                      # 2
    wt = b.all_reduce(a)                                # 3 all_reduce, 4 wait
    m = b.mm(x, w)                                      # 5: independent of the AR
    gm = b.build(b.add(wt, m))                          # 6 add, 7 output
    (info,) = analyze(gm).infos
    # ready at the input (2), needed by the add (6): nodes 3, 4, 5 lie between
    assert (info.ready, info.need, info.slack) == (2, 6, 3)


def test_need_is_the_first_consumer_not_the_last():
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")                   # 0, 1
    wt = b.all_reduce(b.mm(x, w))                       # 2 mm, 3 all_reduce, 4 wait
    m = b.mm(x, w)                                      # 5: independent
    first = b.add(wt, m)                                # 6: first consumer of the wait
    later = b.mm(m, w)                                  # 7
    gm = b.build(b.add(later, wt), first)               # 8: second consumer, 9 output
    (info,) = analyze(gm).infos
    # the value must have arrived by node 6, whatever reads it afterwards
    assert (info.ready, info.need, info.slack) == (2, 6, 3)


def test_returned_wait_is_needed_at_the_output():
    b = GraphBuilder()
    x = b.input("x")                                    # 0
    gm = b.build(b.all_reduce(x))                       # 1 all_reduce, 2 wait, 3 output
    (info,) = analyze(gm).infos
    # the only consumer is the output node
    assert (info.ready, info.need, info.slack) == (0, 3, 2)


def test_diamond_levels():
    a = analyze(diamond())
    # AR2 and AR3 both follow AR1 only; AR4 follows both
    assert list(a.levels().values()) == [1, 2, 2, 3]
    assert (a.lower_bound, a.all_reduce_count, a.at_bound) == (3, 4, False)


def test_independent_chains_bound_is_longest():
    b = GraphBuilder()
    x, y, w = b.input("x"), b.input("y"), b.input("w")
    h, g = x, y
    for _ in range(3):
        h = b.all_reduce(b.mm(h, w))
    for _ in range(2):
        g = b.all_reduce(b.mm(g, w))
    a = analyze(b.build(h, g))
    # chain x: 1, 2, 3; chain y: 1, 2
    assert list(a.levels().values()) == [1, 2, 3, 1, 2]
    # one key, longest chain 3
    assert a.lower_bound == 3
    assert list(a.chains.values()) == [3]


def test_input_depending_on_a_wait():
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    w1 = b.all_reduce(x)
    w2 = b.all_reduce(w1)                               # directly on the wait
    w3 = b.all_reduce(b.mm(w1, w))                      # through compute
    a = analyze(b.build(w2, w3))
    # both depend on AR1 (and not on each other)
    assert list(a.levels().values()) == [1, 2, 2]
    assert a.lower_bound == 2


def test_mixed_dtypes_never_share_a_key():
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    y, v = b.input("y", dtype=torch.bfloat16), b.input("v", dtype=torch.bfloat16)
    w1 = b.all_reduce(b.mm(x, w))                       # f32, level 1
    w2 = b.all_reduce(b.mm(y, v))                       # bf16, level 1
    w3 = b.all_reduce(b.mm(w1, w))                      # f32, level 2
    cast = b.call(aten._to_copy.default, w3, dtype=torch.bfloat16)
    w4 = b.all_reduce(b.add(w2, cast))                  # bf16, level 2 (global 3)
    a = analyze(b.build(w4))
    keys = [i.block.key for i in a.infos]
    # f32 and bf16 blocks get different keys even in the same group
    assert keys[0] == keys[2] and keys[1] == keys[3] and keys[0] != keys[1]
    assert (str(keys[0]), str(keys[1])) == ("sum/float32/cpu/group 0", "sum/bfloat16/cpu/group 0")
    # per-key levels restart for each dtype; global levels count every AR
    assert [i.level for i in a.infos] == [1, 1, 2, 2]
    assert [i.global_level for i in a.infos] == [1, 1, 2, 3]
    # per-key chains of 2 each: the bound is their sum
    assert {str(k): v for k, v in a.chains.items()} == {
        "sum/float32/cpu/group 0": 2, "sum/bfloat16/cpu/group 0": 2}
    assert a.lower_bound == 4


def test_two_groups_are_two_keys():
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    a = analyze(b.build(b.all_reduce(x, group="0"), b.all_reduce(y, group="1")))
    # independent, but different groups cannot share a launch
    assert [i.level for i in a.infos] == [1, 1]
    assert len(a.chains) == 2 and a.lower_bound == 2


def test_inplace_block():
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    wt = b.all_reduce(b.mm(x, w), inplace=True)
    scan = find_comm_blocks(b.build(b.add(wt, x)).graph)
    # an all_reduce_ on a fresh intermediate that nobody reads again is a normal block
    assert (len(scan.blocks), scan.skipped) == (1, [])
    assert scan.blocks[0].inplace


def test_inplace_input_read_again_is_skipped():
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    a = b.mm(x, w)
    wt = b.all_reduce(a, inplace=True)
    gm = b.build(b.add(wt, a))                          # reads `a` after the mutation
    an = analyze(gm)
    ((node, reason),) = an.scan.skipped
    assert node.target is c10d.all_reduce_.default
    assert "read again after the in-place collective" in reason
    # left alone: counted as an all_reduce, but not in the bound (which covers analysed ones)
    assert (an.infos, an.lower_bound, an.all_reduce_count) == ([], 0, 1)


def test_inplace_on_placeholder_is_skipped():
    b = GraphBuilder()
    x = b.input("x")
    ((_, reason),) = find_comm_blocks(b.build(b.all_reduce(x, inplace=True)).graph).skipped
    # mutating a graph input must stay visible to the caller
    assert "mutates a graph input" in reason


def test_symbolic_size_is_analysed_with_hints():
    b = GraphBuilder(dynamic=True)
    x = b.input("x", (4, 8), dynamic=True)
    gm = b.build(b.all_reduce(x))
    # the builder really produced a SymInt size
    assert isinstance(x.meta["val"].shape[0], torch.SymInt)
    scan = find_comm_blocks(gm.graph)
    ((block,),) = [scan.blocks]
    # kept symbolic for the rewrite; bytes from the size hints (4 x 8 float32) for the cap
    assert scan.skipped == [] and block.symbolic and block.nbytes == 4 * 8 * 4


def test_two_waits_is_skipped():
    b = GraphBuilder()
    ar = b.collective(b.input("x"))
    gm = b.build(b.wait(ar), b.wait(ar))
    ((_, reason),) = find_comm_blocks(gm.graph).skipped
    assert "found 2 wait(s) and 0 other user(s)" in reason


def test_wait_outside_the_graph_is_skipped():
    b = GraphBuilder()
    gm = b.build(b.collective(b.input("x")))            # returned un-waited
    ((_, reason),) = find_comm_blocks(gm.graph).skipped
    assert "found 0 wait(s) and 1 other user(s)" in reason


def test_unknown_custom_collective_is_reported():
    b = GraphBuilder()
    x = b.input("x")
    opaque = b.call(torch.ops.fxcoalesce_test.all_reduce.default, x)
    scan = find_comm_blocks(b.build(b.add(opaque, b.all_reduce(x))).graph)
    # the custom op is reported, not rewritten and not counted as an all_reduce
    assert [n.name for n, _ in scan.unknown] == [opaque.name]
    assert (len(scan.blocks), scan.all_reduce_count) == (1, 1)


def test_other_collectives_are_counted():
    b = GraphBuilder()
    x = b.input("x")
    gathered = b.wait(b.call(c10d.all_gather_into_tensor.default, x, 2, "0"))
    scan = find_comm_blocks(b.build(gathered, b.all_reduce(x)).graph)
    # all_gather counted by kind; its wait is not mistaken for anything
    assert (scan.other, scan.unknown, scan.all_reduce_count) == ({"all_gather": 1}, [], 1)


def test_barrier_separates_levels():
    b = GraphBuilder()
    x, y, z = b.input("x"), b.input("y"), b.input("z")
    w1 = b.all_reduce(x)
    copy = b.call(aten.copy_.default, y, w1)            # mutates an input mid-graph
    w2 = b.all_reduce(z)                                # data-independent of AR1
    a = analyze(b.build(w2))
    assert a.barriers == [copy]
    # nothing may move across the copy_, so AR2 counts as after AR1
    assert list(a.levels().values()) == [1, 2]


def _chain_for_timing(links: int) -> GraphModule:
    """h = h + AR(h @ w), built without fake propagation (all values share one fake)."""
    b = GraphBuilder()
    h, w = b.input("x", (2, 2)), b.input("w", (2, 2))
    val = h.meta["val"]
    g = b.graph
    for _ in range(links):
        m = g.call_function(aten.mm.default, (h, w))
        ar = g.call_function(ALL_REDUCE, (m, "sum", "0"))
        wt = g.call_function(WAIT, (ar,))
        h = g.call_function(aten.add.Tensor, (h, wt))
        for n in (m, ar, wt, h):
            n.meta["val"] = val
    return b.build(h)


def test_analyze_is_linear(monkeypatch):
    """Counts the analysis' work (depth-vector merges) instead of timing it: a quadratic
    walk would do 4x the merges for twice the nodes. Wall-clock figures live in
    benchmarks/trace_time.py."""
    import fxcoalesce.analysis as analysis_mod

    merges = []
    real = analysis_mod._vmax
    monkeypatch.setattr(analysis_mod, "_vmax", lambda a, b: merges.append(1) or real(a, b))

    def work(gm):
        merges.clear()
        a = analyze(gm)
        assert a.lower_bound == a.all_reduce_count      # the chain really is analysed
        return len(merges)

    small, large = work(_chain_for_timing(500)), work(_chain_for_timing(1000))  # 2k, 4k nodes
    assert large <= 2 * small + 8  # linear: the same per-node work, plus a constant


# --- property: bound and levels against a reachability oracle; bucketing keeps values ---

@st.composite
def random_dags(draw):
    """Ops (kind, input indices) over 3 inputs; 10-30 ops give 20-60 nodes."""
    ops = []
    for i in range(draw(st.integers(10, 30))):
        kind = draw(st.sampled_from(["mm", "add", "ar"]))
        a, b = draw(st.integers(0, i + 2)), draw(st.integers(0, i + 2))
        ops.append((kind, a, b))
    return ops


def build_dag(ops) -> GraphModule:
    b = GraphBuilder()
    vals = [b.input(n) for n in ("x", "y", "w")]
    for kind, i, j in ops:
        if kind == "ar":
            vals.append(b.all_reduce(vals[i]))  # may read another AR's wait directly
        else:
            vals.append(b.mm(vals[i], vals[j]) if kind == "mm" else b.add(vals[i], vals[j]))
    sinks = [v for v in vals[3:] if not v.users] or vals[-1:]
    return b.build(*sinks)


def oracle_levels(graph: Graph) -> dict[str, int]:
    """Level of each all_reduce = longest path ending there in the AR reachability DAG."""
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n)
        g.add_edges_from((i, n) for i in n.all_input_nodes)
    ars = [n for n in graph.nodes if n.target is ALL_REDUCE]
    h = nx.DiGraph()
    h.add_nodes_from(ars)
    h.add_edges_from((a, d) for a in ars for d in nx.descendants(g, a) if d in h)
    level = {}
    for n in nx.topological_sort(h):
        level[n] = 1 + max((level[p] for p in h.predecessors(n)), default=0)
    longest = len(nx.dag_longest_path(h)) if ars else 0
    assert longest == max(level.values(), default=0)
    return {n.name: lvl for n, lvl in level.items()}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags())
def test_random_dags_reach_the_oracle_bound(ops):
    gm = build_dag(ops)
    expected = oracle_levels(gm.graph)
    a = analyze(gm)
    # levels and bound match the reachability oracle
    assert a.levels() == expected
    assert a.lower_bound == max(expected.values(), default=0)

    # the merging machinery (no cost-model choice): one launch per level, exactly; no
    # reassociation (linearity's sums change the summation order: not bit-exact)
    out, report = run_pipeline(gm, Config(strict=True, slack_aware=False, reassociate=False))
    out.graph.lint()
    assert len(all_reduces(out)) == a.lower_bound == report.all_reduce["after"]
    # every node the passes made carries a fake value
    assert all("val" in n.meta for n in out.graph.nodes if n.op != "output")
    inputs = real_inputs(gm)
    # all_reduce -> mul 2 in both graphs: cat/split/reorder must keep values bit-exact
    for want, got in zip(run(gm, inputs), run(out, inputs), strict=True):
        assert torch.equal(want, got)


def test_oracle_sees_the_diamond():
    # guards the oracle itself: the diamond's levels by reachability
    assert list(oracle_levels(diamond().graph).values()) == [1, 2, 2, 3]

