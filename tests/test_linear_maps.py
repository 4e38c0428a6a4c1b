"""Tier 1 (and one real-ranks check): linearity moves the reduction past what is linear.

Sums over dimensions, reshapes, permutes and transposes, scaling by constants, negation and
in-place adds (functionalized: ``add`` and a ``copy`` back) of all_reduced values: the
reduction moves past them as it does for ``AR(a) + AR(b)`` (issue 34). Llama-4's MoE in
transformers is the model case: ``out = shared(h); out.add_(routed.reshape(k, n, d).sum(0))``.
Hand-built graphs run with every all_reduce as ``mul(x, 2)`` (``graphs.run``): exact under
these reassociations, so values are compared bit for bit; the last test runs a rewritten
graph on 2 real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from graphs import GraphBuilder, all_reduces, calls, real_inputs, run, stale_vals
from torch.fx import GraphModule

from fxcoalesce import Config, run_pipeline
from fxcoalesce.collectives import issue_sequence
from fxcoalesce.testing import simulated_groups

aten = torch.ops.aten
LINEARITY = Config(strict=True, slack_aware=False, passes=("linearity",))
K, N, D = 4, 6, 8  # experts, tokens, hidden


def rewrite(gm: GraphModule, cfg: Config = LINEARITY):
    """The rewritten module and its report: a valid graph, every fake value right, and the
    outputs (values and strides) equal to the input graph's."""
    out, report = run_pipeline(gm, cfg)
    out.graph.lint()
    assert stale_vals(out) == []
    inputs = real_inputs(gm)
    for want, got in zip(run(gm, inputs), run(out, inputs), strict=True):
        assert torch.equal(want, got) and want.stride() == got.stride()
    return out, report


def described(gm: GraphModule) -> list[str]:
    return [d for _, d in issue_sequence(gm.graph)]


def counts(report) -> tuple:
    a = report.all_reduce
    return a["before"], a["after"], a["bytes_before"], a["bytes_after"]


def llama4_moe(b: GraphBuilder, shared_in, routed_in):
    """What AOTAutograd makes of transformers' Llama4TextMoe under tp_plan="auto" (no_grad):
    each all_reduce written back by ``copy(buf, wait)``, the routed one viewed twice and
    summed over the experts' dim, then ``out.add_(...)`` as a functional add."""
    routed = b.call(aten.copy.default, routed_in, b.all_reduce(routed_in))       # [K*N, D]
    routed = b.call(aten.view.default, b.call(aten.view.default, routed, [K, N, D]), [-1, D])
    summed = b.call(aten.sum.dim_IntList, b.call(aten.view.default, routed, [K, -1, D]), [0])
    shared = b.call(aten.copy.default, shared_in, b.all_reduce(shared_in))       # [N, D]
    return b.add(shared, summed)


def test_llama4_moe_becomes_one_all_reduce_of_the_summed_partials():
    b = GraphBuilder()
    r, s, h = b.input("r", (K * N, D)), b.input("s", (N, D)), b.input("h", (N, D))
    out, report = rewrite(b.build(b.add(h, llama4_moe(b, b.add(s, s), b.add(r, r)))))
    (ar,) = all_reduces(out)
    assert ar.args[0].target is aten.add.Tensor  # AR(s + sum_0(reshape(r)))
    assert tuple(ar.meta["val"].shape) == (N, D)
    # 2 launches of (K + 1) N D elements -> 1 of N D
    assert counts(report) == (2, 1, (K + 1) * N * D * 4, N * D * 4)
    assert [x["kind"] for x in report.buckets] == ["sum"]
    # the sum over the experts' dim is named with its input's shape: ranks compare it
    assert described(out) == [
        f"all_reduce(sum, 0) -> float32[{N}, {D}] <- sum(#1,sum[{K}, {N}, {D}]([0])(#0))"]


def test_a_sum_over_a_dim_of_one_all_reduce_moves_past_it():
    """sum_d AR(x) = AR(sum_d x): one launch still, the bytes of the smaller value."""
    b = GraphBuilder()
    x = b.input("x", (K, N, D))
    summed = b.call(aten.sum.dim_IntList, b.all_reduce(b.add(x, x)), [0, 2], True)
    out, report = rewrite(b.build(b.call(aten.relu.default, summed)))
    (ar,) = all_reduces(out)
    assert ar.args[0].target is aten.sum.dim_IntList and counts(report) == (1, 1, 768, 24)
    assert described(out) == [
        f"all_reduce(sum, 0) -> float32[1, {N}, 1] <- sum(sum[{K}, {N}, {D}]([0, 2], True)(#0))"]


def test_symbolic_sizes():
    """A sum over the experts' dim of [s0, s1, s2], summed with a [s1, s2] all_reduce: one
    all_reduce of [s1, s2], right for any sizes."""
    b = GraphBuilder(dynamic=True)
    r = b.input("r", (K, N, D), dynamic=True)
    shared = b.all_reduce(b.call(aten.mul.Tensor, b.call(aten.select.int, r, 0, 0), 3))
    routed = b.call(aten.sum.dim_IntList, b.all_reduce(b.add(r, r)), [0])
    gm = b.build(b.add(shared, routed))
    out, report = run_pipeline(gm, LINEARITY)
    out.graph.lint()
    assert stale_vals(out) == [] and [x["kind"] for x in report.buckets] == ["sum"]
    (ar,) = all_reduces(out)
    assert not any(isinstance(z, int) for z in ar.meta["val"].shape)
    for shape in ((3, 5, 2), (2, 1, 7)):
        t = torch.randn(shape)
        assert torch.equal(run(out, [t])[0], run(gm, [t])[0])


def test_a_mean_of_an_avg_all_reduce_moves_past_it():
    """avg is linear too; the new collective keeps the op."""
    b = GraphBuilder()
    x = b.input("x", (K, N, D))
    mean = b.call(aten.mean.dim, b.all_reduce(b.add(x, x), op="avg"), [0])
    out, report = rewrite(b.build(b.call(aten.relu.default, mean)))
    (ar,) = all_reduces(out)
    assert ar.args[1] == "avg" and tuple(ar.meta["val"].shape) == (N, D)


def test_the_sum_of_a_stack_of_all_reduces():
    b = GraphBuilder()
    xs = [b.input(f"x{i}", (N, D)) for i in range(3)]
    stack = b.call(aten.stack.default, [b.all_reduce(b.add(x, x)) for x in xs])
    out, report = rewrite(b.build(b.call(aten.sum.dim_IntList, stack, [0])))
    assert counts(report) == (3, 1, 3 * N * D * 4, N * D * 4)
    assert calls(out, aten.stack.default) == []


def _decomposed_stack(b, ws):      # torch._refs.stack along 0: view(cat(ws), [3, N, D])
    return b.call(aten.view.default, b.call(aten.cat.default, ws), [len(ws), N, D]), 0


def _decomposed_stack_last(b, ws):  # along the new last dim: cat of unsqueezes
    return b.call(aten.cat.default, [b.call(aten.unsqueeze.default, w, 2) for w in ws], 2), 2


@pytest.mark.parametrize("stack", [_decomposed_stack, _decomposed_stack_last])
def test_the_sum_of_a_stack_as_inductor_decomposes_it(stack):
    b = GraphBuilder()
    xs = [b.input(f"x{i}", (N, D)) for i in range(3)]
    stacked, dim = stack(b, [b.all_reduce(b.add(x, x)) for x in xs])
    out, report = rewrite(b.build(b.call(aten.sum.dim_IntList, stacked, [dim])))
    assert counts(report) == (3, 1, 3 * N * D * 4, N * D * 4)
    assert calls(out, aten.cat.default) == []


def test_a_cat_viewed_otherwise_is_left_alone():
    """view(cat([a, b], 1), [2, N, D]) interleaves the rows: its sum over 0 is no sum of a
    and b."""
    b = GraphBuilder()
    xs = [b.input(f"x{i}", (N, D // 2)) for i in range(2)]
    cat = b.call(aten.cat.default, [b.all_reduce(b.add(x, x)) for x in xs], 1)
    out, report = rewrite(b.build(b.call(aten.sum.dim_IntList, b.call(
        aten.view.default, cat, [2, N // 2, D]), [0])))
    assert len(all_reduces(out)) == 2


def test_a_stack_summed_over_another_dim_is_left_alone():
    b = GraphBuilder()
    xs = [b.input(f"x{i}", (N, D)) for i in range(2)]
    stack = b.call(aten.stack.default, [b.all_reduce(b.add(x, x)) for x in xs])
    out, report = rewrite(b.build(b.call(aten.sum.dim_IntList, stack, [1])))
    assert len(all_reduces(out)) == 2 and report.buckets == []


def test_permutes_scalings_and_negation_go_into_the_partial():
    """-(AR(a) permuted) * 0.5 - AR(b) / 4 * scalar_tensor(3): coefficients and maps are
    replayed on the inputs, and named in the origin."""
    b = GraphBuilder()
    a, c = b.input("a", (D, N)), b.input("c", (N, D))
    pa = b.call(aten.permute.default, b.all_reduce(b.add(a, a)), [1, 0])          # [N, D]
    three = b.call(aten.scalar_tensor.default, 3.0)
    left = b.call(aten.mul.Tensor, b.call(aten.neg.default, pa), 0.5)
    right = b.call(aten.mul.Tensor, b.call(aten.div.Tensor, b.all_reduce(b.add(c, c)), 4), three)
    out, report = rewrite(b.build(b.call(aten.sub.Tensor, left, right)))
    (ar,) = all_reduces(out)
    assert described(out) == [
        f"all_reduce(sum, 0) -> float32[{N}, {D}] <- sum(-0.5*permute[{D}, {N}]([1, 0])(#0),"
        "-0.75*#1)"]


def test_a_lifted_tensor_constant_is_a_coefficient():
    """``x * torch.tensor(0.5)`` in a program: AOTAutograd leaves a ``get_attr`` constant and
    ``lift_fresh_copy``; its value is the graph's, so it is a coefficient (named in the
    origin: a rank whose constant differs issues another sequence)."""
    b = GraphBuilder()
    x, y = b.input("x", (N, D)), b.input("y", (N, D))
    const = b.graph.get_attr("c")
    with b.mode:
        const.meta["val"] = torch.empty(())
    half = b.call(aten.mul.Tensor, b.all_reduce(b.add(x, x)),
                  b.call(aten.lift_fresh_copy.default, const))
    b.graph.output((b.add(half, b.all_reduce(b.add(y, y))),))
    root = torch.nn.Module()
    root.c = torch.tensor(0.5)
    out, report = run_pipeline(GraphModule(root, b.graph), LINEARITY)
    assert stale_vals(out) == [] and [x["kind"] for x in report.buckets] == ["sum"]
    assert described(out) == [f"all_reduce(sum, 0) -> float32[{N}, {D}] <- sum(0.5*#0,#1)"]


def test_ranks_that_permute_differently_issue_different_sequences():
    """One rank's graph cannot see whether its peers permute alike: a rank that transposes a
    square AR before the sum and one that does not would sum different elements. Their
    sequences differ (the origin names the map), so the ranks' agreement falls back to the
    graph without this pass (as for the slice pass's arguments)."""
    def rank_graph(transpose: bool):
        b = GraphBuilder()
        x, y = b.input("x", (D, D)), b.input("y", (D, D))
        w = b.all_reduce(b.add(x, x))
        if transpose:
            w = b.call(aten.transpose.int, w, 0, 1)
        return b.build(b.add(w, b.all_reduce(b.add(y, y))))

    seqs = [described(rewrite(rank_graph(t))[0]) for t in (False, True)]
    assert seqs == [[f"all_reduce(sum, 0) -> float32[{D}, {D}] <- sum(#0,#1)"],
                    [f"all_reduce(sum, 0) -> float32[{D}, {D}] <- sum(transpose[{D}, {D}]"
                     "(0, 1)(#0),#1)"]]


def test_a_sum_of_permuted_terms_keeps_its_layout():
    """AR(a).t() + AR(b).t() is laid out transposed; the all_reduce of the sum reads back
    contiguous, so a copy gives the graph output its strides back."""
    b = GraphBuilder()
    a, c = b.input("a", (D, N)), b.input("c", (D, N))
    ta = b.call(aten.t.default, b.all_reduce(b.add(a, a)))
    tc = b.call(aten.t.default, b.all_reduce(b.add(c, c)))
    root = b.add(ta, tc)
    assert root.meta["val"].stride() == (1, N)
    out, report = rewrite(b.build(root))
    assert counts(report)[:2] == (2, 1) and len(calls(out, aten.empty_strided.default)) == 1


def test_a_sum_read_through_a_transpose_is_summed_again():
    """(AR(a) + AR(b)).t() + AR(c).t(): the first sum's all_reduce is read through a
    transpose by the second tree; a second round sums it with AR(c)."""
    b = GraphBuilder()
    a, c, e = (b.input(n, (D, N)) for n in "ace")
    ab = b.add(b.all_reduce(b.add(a, a)), b.all_reduce(b.add(c, c)))
    root = b.add(b.call(aten.t.default, ab), b.call(aten.t.default, b.all_reduce(b.add(e, e))))
    out, report = rewrite(b.build(b.call(aten.relu.default, root)))
    assert counts(report)[:2] == (3, 1)
    assert described(out) == [f"all_reduce(sum, 0) -> float32[{N}, {D}] <- "
                              f"sum(t[{D}, {N}]()(sum(#0,#1)),t[{D}, {N}]()(#2))"]


def test_an_in_place_add_chain_of_three():
    """out = AR(a); out.add_(AR(b)); out.add_(AR(c).sum(0)): functional adds and copies back
    into the buffer, one all_reduce."""
    b = GraphBuilder()
    a, c, e = b.input("a", (N, D)), b.input("c", (N, D)), b.input("e", (K, N, D))
    buf = b.call(aten.copy.default, a, b.all_reduce(b.add(a, a)))
    buf = b.call(aten.copy.default, a, b.add(buf, b.all_reduce(b.add(c, c))))
    summed = b.call(aten.sum.dim_IntList, b.all_reduce(b.add(e, e)), [0])
    out, report = rewrite(b.build(b.call(aten.relu.default, b.add(buf, summed))))
    assert counts(report)[:2] == (3, 1)


def _max_summed(b, w):                    # max commutes with no sum
    return b.call(aten.sum.dim_IntList, w, [0])


def _times_an_input(b, w):                # a tensor factor might differ between ranks
    return b.call(aten.mul.Tensor, w, b.input("g", (1,)))


def _sum_to_another_dtype(b, w):          # not in the all_reduce's dtype
    return b.call(aten.sum.dim_IntList, w, [0], dtype=torch.float64)


def _times_a_constant_of_several_elements(b, w):   # a factor per element: not a scaling
    return b.call(aten.sum.dim_IntList, b.call(
        aten.mul.Tensor, w, b.call(aten.full.default, [K, 1, 1], 2.0)), [0])


@pytest.mark.parametrize("chain", [_max_summed, _times_an_input, _sum_to_another_dtype,
                                   _times_a_constant_of_several_elements])
def test_left_alone(chain):
    b = GraphBuilder()
    x = b.input("x", (N, D))
    op = "max" if chain is _max_summed else "sum"
    gm = b.build(b.call(aten.relu.default, chain(b, b.all_reduce(b.add(x, x), op=op))))
    out, report = rewrite(gm)
    assert report.buckets == [] and tuple(all_reduces(out)[0].meta["val"].shape) == (N, D)


def test_nothing_moves_without_reassociation():
    b = GraphBuilder()
    x = b.input("x", (K, N, D))
    gm = b.build(b.call(aten.sum.dim_IntList, b.all_reduce(b.add(x, x)), [0]))
    _, report = rewrite(gm, Config(strict=True, reassociate=False, passes=("linearity",)))
    assert report.buckets == []


def test_the_checked_first_all_reduce_keeps_its_size():
    """With run-time checks the group's first all_reduce carries the tag and must keep its
    element count (``tag.pinned``): it is not moved past a sum over a dim; the next is."""
    b = GraphBuilder()
    x, y = b.input("x", (K, N, D)), b.input("y", (K, N, D))
    first = b.call(aten.sum.dim_IntList, b.all_reduce(b.add(x, x)), [0])
    second = b.call(aten.sum.dim_IntList, b.all_reduce(b.add(y, y)), [0])
    gm = b.build(b.call(aten.relu.default, first), b.call(aten.relu.default, second))
    with simulated_groups({"0": (0, 1)}):
        out, report = rewrite(gm, Config(strict=True, slack_aware=False,
                                         passes=("linearity",), run_checks=True))
    assert [tuple(n.meta["val"].shape) for n in all_reduces(out)] == [(K, N, D), (N, D)]


def _ranks_worker(rank, world):
    b = GraphBuilder()
    r, s, h = b.input("r", (K * N, D)), b.input("s", (N, D)), b.input("h", (N, D))
    gm = b.build(b.add(h, llama4_moe(b, b.add(s, s), b.add(r, r))))
    # run_pipeline adds no run-time check; with one, this graph's first all_reduce (the
    # routed one) would keep its size (test_the_checked_first_all_reduce_keeps_its_size)
    out, report = run_pipeline(gm, Config(strict=True, slack_aware=False,
                                          passes=("linearity",), run_checks=False))
    inputs = real_inputs(gm, seed=rank)  # each rank its own partials
    want, got = gm(*[t.clone() for t in inputs]), out(*[t.clone() for t in inputs])
    return {"launches": len(all_reduces(out)), "bytes": report.all_reduce["bytes_after"],
            "max_abs_err": float((want[0] - got[0]).abs().max()),
            "close": torch.allclose(want[0], got[0], rtol=1e-5, atol=1e-5)}


def test_the_rewritten_llama4_moe_on_two_gloo_ranks():
    """The rewritten graph run for real: each rank's partials differ, the one all_reduce of
    the sum gives what the two gave."""
    from fxcoalesce.apps.launch import spawn

    for r in spawn(_ranks_worker, 2, backend="gloo", timeout=300):
        assert (r["launches"], r["bytes"]) == (1, N * D * 4)
        assert r["close"], r["max_abs_err"]


def _ar(x):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def transposed_on_one_rank(h, x, y):
    """Rank 1 transposes its AR(x) before the sum, rank 0 does not: summing the partials
    would add rank 1's transposed partial to rank 0's untransposed one (wrong on both)."""
    import torch.distributed as dist

    a = _ar(x * 2)
    if dist.get_rank() == 1:
        a = a.t()
    return _ar(h), a + _ar(y * 3)


def experts_summed(h, x, y):
    """Llama-4's MoE in program form (after a first all_reduce, which carries the run-time
    check): shared + routed.reshape(k, n, d).sum(0), added in place."""
    first = _ar(h)
    out = _ar(y * 3)
    routed = torch.cat([x * (i + 1) for i in range(K)])                  # [K * n, d]
    out.add_(_ar(routed).reshape(K, D, D).sum(dim=0))
    return first, out


def _compiled_run(rank, world, name):
    import torch.distributed._functional_collectives as funcol

    import fxcoalesce

    torch.set_num_threads(1)
    fn = {"transposed": transposed_on_one_rank, "summed": experts_summed}[name]
    gen = torch.Generator().manual_seed(100 + rank)  # values differ by rank, shapes do not
    args = [torch.randn(D, D, generator=gen) for _ in range(3)]
    reports = []
    torch._dynamo.reset()
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager"),
                            on_graph=lambda b, a, r: reports.append(r))
    got = torch.compile(fn, backend=be, fullgraph=True)(*[t.clone() for t in args])
    with torch.no_grad():
        want = [t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
                for t in fn(*[t.clone() for t in args])]
    return {"got": got, "want": want, "kinds": [[b["kind"] for b in r.buckets] for r in reports],
            "launches": [r.all_reduce["after"] for r in reports]}


@pytest.mark.parametrize("name, kinds, launches", [
    ("transposed", [["cat"]], [2]),   # the ranks' sums differ: bucketed, without linearity
    ("summed", [["sum"]], [2])])      # the same maps on every rank: summed
def test_on_real_ranks_maps_are_agreed_on(name, kinds, launches):
    from fxcoalesce.apps.launch import spawn

    for r in spawn(_compiled_run, 2, (name,), backend="gloo", timeout=300):
        assert (r["kinds"], r["launches"]) == (kinds, launches)
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want)
