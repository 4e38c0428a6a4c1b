"""Tier 1: the bucket and schedule passes on hand-built ATen graphs (no process group)."""

from __future__ import annotations

import pytest
import torch
from graphs import GraphBuilder, all_reduces, calls, diamond, ops, position, real_inputs, run
from torch.fx import GraphModule

from fxcoalesce import Config, analyze, run_pipeline
from fxcoalesce.collectives import ALL_REDUCE, WAIT

aten = torch.ops.aten
BUCKET_ONLY = Config(strict=True, passes=("bucket",))
SCHEDULE_ONLY = Config(strict=True, passes=("schedule",))


def same_values(before: GraphModule, after: GraphModule) -> bool:
    """Equal outputs, bit for bit, with every all_reduce replaced by mul 2 in both graphs."""
    inputs = real_inputs(before)
    return all(torch.equal(a, b) for a, b in zip(run(before, inputs), run(after, inputs),
                                                    strict=True))


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def shape_of(node):
    val = node.meta["val"]
    return [tuple(v.shape) for v in val] if isinstance(val, list) else tuple(val.shape)


def independent_pair() -> GraphModule:
    """Two all_reduces of different shapes that depend on nothing but inputs."""
    b = GraphBuilder()
    x, y = b.input("x", (4, 8)), b.input("y", (2, 3))
    wa = b.all_reduce(b.add(x, x))
    wc = b.all_reduce(b.add(y, y))
    return b.build(b.add(wa, x), b.add(wc, y))



def test_diamond_reaches_three_launches():
    gm = diamond()
    out, report = run_pipeline(gm, Config(strict=True))
    out.graph.lint()
    # AR2 and AR3 share level 2: 4 launches become 3
    assert len(all_reduces(out)) == 3
    a = report.all_reduce
    assert (a["before"], a["after"], a["lower_bound"]) == (4, 3, 3)
    assert report.verdict == "reached the lower bound"
    # the input graph is left as it was
    assert len(all_reduces(gm)) == 4
    assert same_values(gm, out)


def test_independent_pair_exact_order_and_meta():
    gm = independent_pair()
    consumers = [n.name for n in calls(gm, aten.add.Tensor)[2:]]
    out, report = run_pipeline(gm, BUCKET_ONLY)
    out.graph.lint()
    # issued right after the last member's input (the second add); consumers follow the split
    assert ops(out) == [
        "placeholder", "placeholder", "add.Tensor", "add.Tensor",
        "reshape.default", "reshape.default", "cat.default", "all_reduce.default",
        "wait_tensor.default", "split_with_sizes.default",
        "getitem", "reshape.default", "getitem", "reshape.default",
        "add.Tensor", "add.Tensor", "output",
    ]
    # the consumers are the same nodes, now reading the reshaped split parts
    pos = position(out)
    assert [n.name for n in calls(out, aten.add.Tensor)[2:]] == consumers
    for name, shape in zip(consumers, [(4, 8), (2, 3)]):
        node = next(n for n in out.graph.nodes if n.name == name)
        src = node.args[0]
        assert src.target is aten.reshape.default and src.args[1] == list(shape)
        assert pos[src.name] < pos[name]
    # every node carries a fake value of the right shape: 32 + 6 elements through the bucket
    assert [shape_of(n) for n in out.graph.nodes if n.op == "call_function"] == [
        (4, 8), (2, 3), (32,), (6,), (38,), (38,), (38,), [(32,), (6,)],
        (32,), (4, 8), (6,), (2, 3), (4, 8), (2, 3)]
    assert len(report.buckets) == 1
    assert same_values(gm, out)


def test_bucket_report_lists_members_bytes_level():
    gm = diamond()
    members = [n.name for n in all_reduces(gm)[1:3]]
    out, report = run_pipeline(gm, BUCKET_ONLY)
    (bucket,) = report.buckets
    # AR2 and AR3 (4x4 f32 = 64 bytes each) at level 2
    assert bucket["members"] == members
    assert (bucket["nbytes"], bucket["level"]) == (128, 2)
    assert bucket["key"] == "sum/float32/cpu/group 0"
    # the fused collective exists in the result and the members do not
    names = {n.name for n in all_reduces(out)}
    assert bucket["collective"] in names and not names & set(members)


def test_chain_is_left_unchanged():
    b = GraphBuilder()
    h, w = b.input("x"), b.input("w")
    for _ in range(4):
        h = b.add(h, b.all_reduce(b.mm(h, w)))
    gm = b.build(h)
    out, report = run_pipeline(gm, Config(strict=True))
    # no merge is possible and the schedule is already tight: same code
    assert out.code == gm.code
    assert (report.all_reduce["after"], report.buckets) == (4, [])
    assert report.verdict.startswith("already at its bound")


def test_mixed_dtypes_one_bucket_per_dtype():
    b = GraphBuilder()
    xs = [b.input(f"x{i}") for i in range(2)]
    ys = [b.input(f"y{i}", dtype=torch.bfloat16) for i in range(2)]
    waits = [b.all_reduce(b.add(v, v)) for v in (xs[0], ys[0], xs[1], ys[1])]
    gm = b.build(*waits)
    out, report = run_pipeline(gm, Config(strict=True))
    out.graph.lint()
    # f32 pair and bf16 pair, never mixed
    assert len(all_reduces(out)) == 2
    assert sorted(bk["key"] for bk in report.buckets) == [
        "sum/bfloat16/cpu/group 0", "sum/float32/cpu/group 0"]
    assert sorted(str(n.args[0].meta["val"].dtype) for n in all_reduces(out)) == [
        "torch.bfloat16", "torch.float32"]
    assert same_values(gm, out)


def test_two_groups_two_buckets():
    b = GraphBuilder()
    xs = [b.input(f"x{i}") for i in range(4)]
    gm = b.build(*[b.all_reduce(x, group=g) for x, g in zip(xs, "0101")])
    out, _ = run_pipeline(gm, Config(strict=True))
    # one launch per group
    assert sorted(n.args[2] for n in all_reduces(out)) == ["0", "1"]


def test_bucket_cap_splits_a_level():
    b = GraphBuilder()
    xs = [b.input(f"x{i}", (4, 8)) for i in range(3)]  # 128 bytes each
    gm = b.build(*[b.all_reduce(x) for x in xs])
    cap_mb = 300 / (1024 * 1024)                        # two fit, the third does not
    out, report = run_pipeline(gm, Config(strict=True, bucket_cap_mb=cap_mb))
    # one bucket of two plus one left alone: above the bound of 1, and the report says so
    assert len(all_reduces(out)) == 2
    assert [len(bk["members"]) for bk in report.buckets] == [2]
    assert (report.all_reduce["after"], report.all_reduce["lower_bound"]) == (2, 1)
    assert "above the bound" in report.verdict
    assert same_values(gm, out)


def test_consumer_before_last_input_is_moved():
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    wa = b.all_reduce(b.add(x, x))
    early = b.add(wa, x)                                # consumes AR1 before y's add exists
    wc = b.all_reduce(b.add(y, y))
    gm = b.build(early, wc)
    out, _ = run_pipeline(gm, BUCKET_ONLY)
    out.graph.lint()
    # the early consumer now follows the fused wait's split; the returned part is cloned
    assert ops(out) == [
        "placeholder", "placeholder", "add.Tensor", "add.Tensor",
        "reshape.default", "reshape.default", "cat.default", "all_reduce.default",
        "wait_tensor.default", "split_with_sizes.default",
        "getitem", "reshape.default", "add.Tensor", "getitem", "reshape.default",
        "clone.default", "output",
    ]
    assert same_values(gm, out)


def test_inplace_members_are_fused():
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    wa = b.all_reduce(b.add(x, x), inplace=True)
    wc = b.all_reduce(b.add(y, y), inplace=True)
    gm = b.build(b.add(wa, wc))
    out, report = run_pipeline(gm, Config(strict=True))
    out.graph.lint()
    # two in-place blocks become one functional all_reduce on the concatenation
    assert [n.target for n in all_reduces(out)] == [ALL_REDUCE]
    assert len(report.buckets) == 1
    assert same_values(gm, out)


def test_inplace_member_seen_through_a_view():
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    a = b.add(x, x)
    view = b.call(aten.view.default, a, [16])           # aliases `a`, read after the AR
    wa = b.all_reduce(a, inplace=True)
    wc = b.all_reduce(b.add(y, y), inplace=True)
    gm = b.build(b.add(wa, wc), b.call(aten.mul.Tensor, view, 3))
    out, _ = run_pipeline(gm, Config(strict=True))
    # the view must still see the reduced values
    assert same_values(gm, out)


def test_skipped_collectives_are_left_alone():
    b = GraphBuilder()
    x, y, z = b.input("x"), b.input("y"), b.input("z")
    twice = b.collective(z)                             # two waits: left alone
    gm = b.build(b.all_reduce(x), b.all_reduce(y), b.wait(twice), b.wait(twice))
    out, report = run_pipeline(gm, Config(strict=True))
    # the pair is fused, the odd one survives untouched
    assert len(all_reduces(out)) == 2
    assert twice.name in {n.name for n in all_reduces(out)}
    # the bound covers the two analysed ones; the report says one more was left alone, and why
    a = report.all_reduce
    assert (a["after"], a["lower_bound"], a["left_alone"]) == (2, 1, 1)
    assert report.verdict.startswith("reached the lower bound; 1 all_reduce(s) left alone")
    assert "found 2 wait(s)" in report.verdict
    assert any("left alone" in w and twice.name in w for w in report.warnings)


def test_schedule_moves_wait_after_independent_compute():
    b = GraphBuilder()
    x, y, w = b.input("x"), b.input("y"), b.input("w")
    wt = b.all_reduce(b.mm(x, w))
    gm = b.build(b.add(wt, b.mm(y, w)))
    out, report = run_pipeline(gm, SCHEDULE_ONLY)
    # the independent mm now runs while the all_reduce is in flight
    assert ops(out) == ["placeholder"] * 3 + [
        "mm.default", "all_reduce.default", "mm.default", "wait_tensor.default",
        "add.Tensor", "output"]
    assert report.passes[0]["changed"]


def test_schedule_issues_the_collective_right_after_its_input():
    b = GraphBuilder()
    x, y, w = b.input("x"), b.input("y"), b.input("w")
    a = b.mm(x, w)                                      # the all_reduce's input
    m = b.mm(y, w)                                      # independent, before the AR in
    wt = b.all_reduce(a)                                # program order
    gm = b.build(b.add(wt, m))
    out, _ = run_pipeline(gm, SCHEDULE_ONLY)
    pos = position(out)
    # moved up past the independent mm, which now overlaps the all_reduce
    assert pos[all_reduces(out)[0].name] == pos[a.name] + 1 < pos[m.name]


def test_schedule_does_not_cross_a_barrier():
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    w1 = b.all_reduce(b.mm(x, x))
    b.call(aten.copy_.default, y, w1)                   # mutates y mid-graph
    gm = b.build(b.all_reduce(y))                       # ready at y, but must see the copy
    out, _ = run_pipeline(gm, SCHEDULE_ONLY)
    pos = position(out)
    (copy,) = calls(out, aten.copy_.default)
    # issued as early as allowed: right after the copy_, not right after y
    assert pos[all_reduces(out)[1].name] == pos[copy.name] + 1
    assert same_values(gm, out)


def test_merge_after_barrier_stays_after_it():
    b = GraphBuilder()
    x, y, z = b.input("x"), b.input("y"), b.input("z")
    w1 = b.all_reduce(b.mm(x, x))
    b.call(aten.copy_.default, y, w1)                   # mutates y mid-graph
    w2 = b.all_reduce(b.add(y, y))                      # reads the new y
    w3 = b.all_reduce(b.add(z, z))
    gm = b.build(w2, w3)
    out, _ = run_pipeline(gm, Config(strict=True))
    pos = position(out)
    (copy,) = calls(out, aten.copy_.default)
    fused = [n for n in all_reduces(out) if pos[n.name] > pos[copy.name]]
    # AR2+AR3 fused after the copy_, AR1 still before it
    assert len(all_reduces(out)) == 2 and len(fused) == 1
    assert same_values(gm, out)


def test_merge_never_crosses_a_barrier():
    """Two all_reduces after a copy_ into y, on inputs defined before it (y itself)."""
    b = GraphBuilder()
    x, y, z = b.input("x"), b.input("y"), b.input("z")
    w1 = b.all_reduce(b.mm(x, x))
    b.call(aten.copy_.default, y, w1)
    gm = b.build(b.all_reduce(y), b.all_reduce(z))      # AR(y) must see the copied value
    out, _ = run_pipeline(gm, BUCKET_ONLY)
    pos = position(out)
    (copy,) = calls(out, aten.copy_.default)
    # both all_reduces of level 2 stay after the copy_
    assert len(all_reduces(out)) == 2
    assert all(pos[n.name] > pos[copy.name] for n in all_reduces(out)[1:])
    assert same_values(gm, out)


def test_all_reduce_of_a_fused_wait():
    """AR3 = AR(wait of AR1), AR4 = AR(wait of AR2): levels {1, 1}, {2, 2}."""
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    w1, w2 = b.all_reduce(x), b.all_reduce(y)
    gm = b.build(b.add(b.all_reduce(w1), b.all_reduce(w2)))
    out, _ = run_pipeline(gm, Config(strict=True))
    out.graph.lint()
    # one launch per level
    assert len(all_reduces(out)) == 2
    assert same_values(gm, out)


def test_fused_graph_outputs_do_not_alias():
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    gm = b.build(b.all_reduce(b.add(x, x)), b.all_reduce(b.add(y, y)))
    out, _ = run_pipeline(gm, Config(strict=True))
    # each returned part is cloned out of the shared buffer
    assert len(calls(out, aten.clone.default)) == 2
    r1, r2 = run(out, real_inputs(gm))
    assert not shares_storage(r1, r2)


def test_fused_graph_outputs_through_views_do_not_alias():
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    wa, wc = b.all_reduce(b.add(x, x)), b.all_reduce(b.add(y, y))
    gm = b.build(b.call(aten.view.default, wa, [16]), b.call(aten.view.default, wc, [16]))
    out, _ = run_pipeline(gm, Config(strict=True))
    assert len(all_reduces(out)) == 1
    r1, r2 = run(out, real_inputs(gm))
    # returned views of separate all_reduces must not share one storage
    assert not shares_storage(r1, r2)


def test_interlocked_keys_fall_back_to_global_levels():
    """A1 -> B1 and B2 -> A2: merging {A1, A2} and {B1, B2} would make a cycle."""
    b = GraphBuilder()
    x, y = b.input("x"), b.input("y", dtype=torch.bfloat16)
    f32 = lambda n: b.call(aten._to_copy.default, n, dtype=torch.float32)  # noqa: E731
    bf16 = lambda n: b.call(aten._to_copy.default, n, dtype=torch.bfloat16)  # noqa: E731
    a1 = b.all_reduce(b.add(x, x))
    b1 = b.all_reduce(bf16(a1))
    b2 = b.all_reduce(b.add(y, y))
    a2 = b.all_reduce(f32(b2))
    gm = b.build(b1, a2)
    # per-key levels all 1, but the per-key antichains interlock
    assert [i.level for i in analyze(gm).infos] == [1, 1, 1, 1]
    out, report = run_pipeline(gm, Config(strict=True))
    out.graph.lint()
    # the fallback makes no cycle; global levels {A1, B2}, {B1, A2} share no key, so it
    # merges nothing (merging A1 with A2 alone would give the true minimum, 3)
    assert len(all_reduces(out)) == 4
    assert any("interlock" in w for w in report.warnings)
    assert same_values(gm, out)


def test_wait_meta_matches_collective_input():
    gm = diamond()
    out, _ = run_pipeline(gm, Config(strict=True))
    # every wait's fake value has the shape of its collective's input
    for n in calls(out, WAIT):
        assert n.meta["val"].shape == n.args[0].args[0].meta["val"].shape
