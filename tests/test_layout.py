"""Tier 1: linearity and slice see through layout-only ops between a wait and its consumer.

transformers' DeepSeek-V3 MoE adds ``routed.view(shape) + shared``; DTensor's ``to_local``
leaves a ``view`` after every wait, and AOTAutograd writes an in-place ``dist.all_reduce(t)``
back with a functional ``copy(t, wait)``. Before ``passes.layout`` those all_reduces were
bucketed (same bytes) instead of summed.
"""

from __future__ import annotations

import pytest
import torch
from graphs import GraphBuilder, all_reduces, calls, real_inputs, run, stale_vals
from torch.fx import GraphModule

from fxcoalesce import Config, run_pipeline
from fxcoalesce.collectives import issue_sequence

aten = torch.ops.aten
LINEARITY = Config(strict=True, slack_aware=False, passes=("linearity",))
SLICE = Config(strict=True, passes=("slice",))
H = (1, 6, 8)  # [B, S, H]


def rewrite(gm: GraphModule, cfg: Config = LINEARITY):
    """The rewritten module and its report; the graph is valid, every node's fake value is
    what its op gives, and the outputs equal the input graph's (all_reduce -> mul 2: exact
    under reassociation, as scaling by 2 is)."""
    out, report = run_pipeline(gm, cfg)
    out.graph.lint()
    assert stale_vals(out) == []
    inputs = real_inputs(gm)
    for want, got in zip(run(gm, inputs), run(out, inputs), strict=True):
        assert torch.equal(want, got)
    return out, report


def view(b: GraphBuilder, x, shape):
    return b.call(aten.view.default, x, list(shape))


def routed_plus_shared() -> GraphModule:
    """transformers' DeepseekV3MoE: ``experts(flat).view(*orig_shape) + shared(x)``."""
    b = GraphBuilder()
    x, w, r = b.input("x", (6, 8)), b.input("w", (8, 8)), b.input("r", H)
    routed = b.all_reduce(b.mm(x, w))                      # [6, 8]
    shared = b.all_reduce(b.add(r, r))                     # [1, 6, 8]
    return b.build(b.add(r, b.add(view(b, routed, H), shared)))


def test_routed_view_plus_shared_becomes_one_sum():
    out, report = rewrite(routed_plus_shared())
    (ar,) = all_reduces(out)
    # one all_reduce of the summed partials, in the shape the add reads
    assert tuple(ar.meta["val"].shape) == H
    (bucket,) = report.buckets
    assert bucket["kind"] == "sum"
    assert bucket["members"] == ["all_reduce_default", "all_reduce_default_1"]
    a = report.all_reduce
    assert (a["before"], a["after"], a["bytes_before"], a["bytes_after"]) == (2, 1, 384, 192)
    assert bucket["nbytes"] == 192  # the new collective's bytes: one member's


def test_each_partial_goes_through_its_own_layout_ops():
    """What DTensor + AOTAutograd emit in transformers' DeepSeek-V3 (grad mode): the routed
    all_reduce written back by ``copy(buf, wait)`` and viewed twice, the shared one viewed to
    its own shape."""
    b = GraphBuilder()
    x, w, r = b.input("x", (6, 8)), b.input("w", (8, 8)), b.input("r", H)
    p = b.mm(x, w)
    routed = view(b, view(b, b.call(aten.copy.default, p, b.all_reduce(p)), (48,)), H)
    shared = view(b, b.all_reduce(b.add(r, r)), H)
    out, report = rewrite(b.build(b.add(r, b.add(routed, shared))))
    (ar,) = all_reduces(out)
    assert [b["kind"] for b in report.buckets] == ["sum"]
    # the copy's value is its source's; each view is replayed once, as a reshape
    assert calls(out, aten.copy.default) == [] and calls(out, aten.view.default) == []
    assert [tuple(n.meta["val"].shape) for n in calls(out, aten.reshape.default)] == [(48,), H]
    assert ar.args[0].target is aten.add.Tensor


def _unsqueeze(b, w):
    return b.call(aten.unsqueeze.default, w, 0)


def _flatten_unflatten(b, w):
    return b.call(aten.unflatten.int, b.call(aten.flatten.using_ints, w), 0, list(H))


def _expand_adds_a_dim(b, w):
    return b.call(aten.expand.default, w, list(H))


def _clone_then_reshape(b, w):
    return b.call(aten.reshape.default, b.call(aten.clone.default, w,
                                               memory_format=torch.contiguous_format), list(H))


def _squeeze_alias_unsafe_view(b, w):
    w = b.call(aten.alias.default, b.call(aten.unsqueeze.default, w, 1))   # [6, 1, 8]
    return b.call(aten._unsafe_view.default, b.call(aten.squeeze.dim, w, 1), list(H))


@pytest.mark.parametrize("chain", [_unsqueeze, _flatten_unflatten, _expand_adds_a_dim,
                                   _clone_then_reshape, _squeeze_alias_unsafe_view])
def test_layout_only_ops_are_seen_through(chain):
    b = GraphBuilder()
    x, w, r = b.input("x", (6, 8)), b.input("w", (8, 8)), b.input("r", H)
    shared = b.all_reduce(b.add(r, r))
    out, report = rewrite(b.build(b.add(chain(b, b.all_reduce(b.mm(x, w))), shared)))
    # 2 -> 1, of the [1, 6, 8] the add reads
    assert [tuple(n.meta["val"].shape) for n in all_reduces(out)] == [H]
    assert [b["kind"] for b in report.buckets] == ["sum"]


def test_coefficients_apply_to_the_replayed_partial():
    b = GraphBuilder()
    x, r = b.input("x", (6, 8)), b.input("r", H)
    routed = view(b, b.all_reduce(b.add(x, x)), H)
    shared = b.all_reduce(b.add(r, r))
    # shared / 2 - 3 * routed
    tree = b.call(aten.sub.Tensor, b.call(aten.div.Tensor, shared, 2),
                  b.call(aten.mul.Tensor, routed, 3))
    out, _ = rewrite(b.build(tree))
    (ar,) = all_reduces(out)
    # all_reduce(0.5 * q - 3 * reshape(p))
    assert [n.args[1] for n in calls(out, aten.mul.Tensor)] == [0.5, -3]


def test_symbolic_sizes_are_replayed_with_their_size_nodes():
    b = GraphBuilder(dynamic=True)
    x = b.input("x", (6, 8), dynamic=True)                   # [s0, s1]
    s0, s1 = (b.call(aten.sym_size.int, x, d) for d in (0, 1))
    routed = view(b, b.all_reduce(b.add(x, x)), (1, s0, s1))
    shared = b.all_reduce(b.call(aten.unsqueeze.default, b.add(x, x), 0))
    gm = b.build(b.add(routed, shared))
    out, report = run_pipeline(gm, LINEARITY)
    out.graph.lint()
    assert stale_vals(out) == [] and [b["kind"] for b in report.buckets] == ["sum"]
    (ar,) = all_reduces(out)
    (reshape,) = calls(out, aten.reshape.default)
    # the reshape reads the graph's own size nodes, and the sum is reduced at [1, s0, s1]
    assert [getattr(a, "name", a) for a in reshape.args[1]] == [1, s0.name, s1.name]
    assert not any(isinstance(s, int) for s in ar.meta["val"].shape[1:])
    for rows in (3, 5):  # runs for any length
        t = torch.randn(rows, 4)
        assert torch.equal(run(out, [t])[0], run(gm, [t])[0])


def test_the_sum_keeps_the_first_members_issue_place():
    """The fused sum is issued where its first member was: before an independent max that
    the program issues between the two sums."""
    b = GraphBuilder()
    x, y, r = b.input("x", (6, 8)), b.input("y", (4, 4)), b.input("r", H)
    routed = b.all_reduce(b.add(x, x))
    top = b.all_reduce(b.add(y, y), op="max")
    shared = b.all_reduce(b.add(r, r))
    out, _ = rewrite(b.build(b.add(view(b, routed, H), shared), top))
    assert [d for _, d in issue_sequence(out.graph)] == [
        "all_reduce(sum, 0) -> float32[1, 6, 8] <- sum(#0,#2)",
        "all_reduce(max, 0) -> float32[4, 4] <- #1"]


def test_outputs_alias_as_before():
    b = GraphBuilder()
    x, r = b.input("x", (6, 8)), b.input("r", H)
    total = b.add(view(b, b.all_reduce(b.add(x, x)), H), b.all_reduce(b.add(r, r)))
    gm = b.build(total, view(b, total, (48,)))
    out, _ = rewrite(gm)
    a, v = run(out, real_inputs(gm))
    # the second output is a view of the first, as it was
    assert a.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


def _wait_read_twice(b, w):
    b.extra.append(w)
    return view(b, w, H)


def _view_read_twice(b, w):
    v = view(b, w, H)
    b.extra.append(v)
    return v


def _broadcast(b, w):                   # [6, 8] + [1, 6, 8] broadcasts: no layout op at all
    return w


@pytest.mark.parametrize("chain", [_wait_read_twice, _view_read_twice, _broadcast])
def test_left_alone(chain):
    b = GraphBuilder()
    b.extra = []
    x, r = b.input("x", (6, 8)), b.input("r", H)
    shared = b.all_reduce(b.add(r, r))
    gm = b.build(b.add(chain(b, b.all_reduce(b.add(x, x))), shared), *b.extra)
    out, report = rewrite(gm)
    assert len(all_reduces(out)) == 2 and report.buckets == []


def test_a_transpose_is_seen_through_and_named_in_the_origin():
    """A transpose reorders elements: the sum is right only where every rank transposes
    alike, so the new collective's origin names it (with its input's shape), and ranks whose
    graphs differ there issue different sequences (``tests/test_linear_maps.py``)."""
    b = GraphBuilder()
    x, r = b.input("x", (6, 8)), b.input("r", H)
    w = b.all_reduce(b.add(x, x))
    t = b.call(aten.unsqueeze.default, b.call(aten.t.default, b.call(
        aten.reshape.default, w, [8, 6])), 0)
    out, report = rewrite(b.build(b.add(t, b.all_reduce(b.add(r, r)))))
    assert [b["kind"] for b in report.buckets] == ["sum"]
    assert [d for _, d in issue_sequence(out.graph)] == [
        "all_reduce(sum, 0) -> float32[1, 6, 8] <- sum(t[8, 6]()(#0),#1)"]


def test_a_copy_into_a_buffer_made_later_is_seen_through_in_the_tree():
    """``copy(dst, src)`` of one shape and dtype is ``src``: in the tree of adds it needs no
    replay, so a destination made after the wait does not matter there (``out.add_(...)``
    functionalized)."""
    b = GraphBuilder()
    x, r = b.input("x", (6, 8)), b.input("r", H)
    copied = b.call(aten.copy.default, b.call(aten.ones.default, list(H)),
                    view(b, b.all_reduce(b.add(x, x)), H))
    out, report = rewrite(b.build(b.add(copied, b.all_reduce(b.add(r, r)))))
    assert [b["kind"] for b in report.buckets] == ["sum"] and len(all_reduces(out)) == 1


def test_an_expand_that_grows_is_not_seen_through():
    b = GraphBuilder()
    x, r = b.input("x", (1, 8)), b.input("r", (6, 8))
    # [1, 8] -> [6, 8]: the sum would reduce 6 times the bytes of this member
    grown = b.call(aten.expand.default, b.all_reduce(b.add(x, x)), [6, 8])
    out, report = rewrite(b.build(b.add(grown, b.all_reduce(b.add(r, r)))))
    assert len(all_reduces(out)) == 2 and report.buckets == []


def test_nothing_seen_through_without_reassociation():
    out, report = rewrite(routed_plus_shared(), Config(strict=True, reassociate=False))
    assert [b["kind"] for b in report.buckets] == ["cat"]  # bucketed instead: exact


def test_slice_sees_through_a_view():
    b = GraphBuilder()
    x = b.input("x", (16, 16))
    w = view(b, b.all_reduce(b.add(x, x)), (2, 8, 16))
    gm = b.build(b.call(aten.select.int, w, 1, -1))          # last token of [B, S, H]
    out, report = rewrite(gm, SLICE)
    (ar,) = all_reduces(out)
    assert tuple(ar.meta["val"].shape) == (2, 16)
    assert (report.all_reduce["bytes_before"], report.all_reduce["bytes_after"]) == (1024, 128)
    ((_, described),) = issue_sequence(out.graph)
    assert described == "all_reduce(sum, 0) -> float32[2, 16] <- select(1, -1)(#0)"


def test_slice_left_alone_when_the_view_is_read_twice():
    b = GraphBuilder()
    x = b.input("x", (16, 16))
    w = view(b, b.all_reduce(b.add(x, x)), (2, 8, 16))
    out, report = rewrite(b.build(b.call(aten.select.int, w, 1, -1), w), SLICE)
    assert report.buckets == [] and tuple(all_reduces(out)[0].meta["val"].shape) == (16, 16)


def test_a_chain_of_sums_of_sums_is_summed_link_by_link():
    """Found by the life-of-a-job property test (issue 25): s1 = AR(x0) + AR(x1), then
    s2 = AR(s1) + AR(x1). Summing s1 replaced the node AR(s1) reads; the second sum read it
    from the analysis made before (an erased node: KeyError) instead of the graph."""
    from graphs import GraphBuilder

    from fxcoalesce import Config, run_pipeline

    b = GraphBuilder()
    x0, x1 = b.input("x0", (2, 2), torch.float64), b.input("x1", (2, 2), torch.float64)
    s1 = b.add(b.all_reduce(x0), b.all_reduce(x1))
    gm = b.build(b.add(b.all_reduce(s1), b.all_reduce(x1)))
    out, report = run_pipeline(gm, Config(strict=True, passes=("linearity",)))
    out.graph.lint()
    assert (report.all_reduce["before"], report.all_reduce["after"]) == (4, 2)
    assert [b["kind"] for b in report.buckets] == ["sum", "sum"]
