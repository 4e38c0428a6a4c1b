"""Tier 3: graphs that differ between ranks. Whatever compute a rank adds, every rank issues
the same collectives in the same order, and the values equal plain eager execution.

Each case is a function with rank-dependent compute (Dynamo turns ``dist.get_rank()`` into a
constant, so each rank compiles a different graph). Before the fix, the passes placed each
collective where its inputs became ready, and that place moves with a rank's extra compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import fxcoalesce
from fxcoalesce.apps.launch import spawn
from fxcoalesce.collectives import issue_sequence


def ar(x, op="sum"):
    return funcol.all_reduce(x, op, dist.group.WORLD)


def eager(fn, args):
    """``fn(*args)`` run eagerly with every collective waited for (eager funcol returns
    in-flight AsyncCollectiveTensors, which must not be shipped back to the parent)."""
    with torch.no_grad():
        out = fn(*args)
    return tuple(t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t for t in out)


def sum_bias_then_max(x, y, bias):
    """A row-parallel bias added on rank 0 only, before a sum; an independent max of the same
    size. Rank 0's sum input is ready after the max's: the old schedule swapped them there,
    silently exchanging the two results."""
    h = x * 2
    hy = x.flip(0) * 3
    if dist.get_rank() == 0:
        h = h + bias
    return ar(h) + 1, ar(hy, "max") - 1


def sizes_differ_bucket_only(x, y, bias):
    """Two sums that fuse around a max of another size; rank 0's late bias moved the fused
    sum after the max there (gloo: "Received data size doesn't match")."""
    a, b, m = x * 2, x * 3, y * 5
    rm = ar(m, "max")
    if dist.get_rank() == 0:
        a = a + bias
    return ar(a), ar(b), rm


def two_buckets_swap(x, y, bias):
    """Four same-size sums split by a small cap into two buckets of the same size; the bias
    moved the first bucket after the second on rank 0 (silently wrong). (A max first: a
    graph's first all_reduce carries the run-time check and joins no bucket.)"""
    head = ar(y, "max")
    a, b, c, d = x * 2, x * 3, x * 4, x * 5
    if dist.get_rank() == 0:
        a = a + bias
    return head, ar(a), ar(b), ar(c), ar(d)


def extra_compute_between(x, y, bias):
    """A rank-dependent amount of compute (rank r: r tanh) before a max, and dependent sums:
    each rank's max input is ready at another point relative to the sum's."""
    h = x * 2
    g = y
    for _ in range(dist.get_rank()):
        g = torch.tanh(g) + bias
    s1 = ar(h)
    m = ar(g, "max")
    return ar(s1 * 3) + ar(s1 - 1), m


def rank_branch(x, y, bias):
    """A branch Dynamo specializes: even ranks reduce an input as it is, odd ranks compute it
    late; the fused pair moved across the independent max on odd ranks."""
    p = x * 2
    v = y * 2
    if dist.get_rank() % 2:
        q = torch.relu(x @ x.t()) @ x + bias
    else:
        q = x
    return ar(v, "max"), ar(p), ar(q)


CASES = {  # name: (function, Config overrides, all_reduce launches before -> after)
    "sum_bias_then_max": (sum_bias_then_max, {}, (2, 2)),
    "sizes_differ_bucket_only": (sizes_differ_bucket_only, {"passes": ("bucket",)}, (3, 2)),
    "two_buckets_swap": (two_buckets_swap, {"bucket_cap_mb": 2 * 8 * 16 * 4 / 2**20}, (5, 3)),
    "extra_compute_between": (extra_compute_between, {}, (4, 3)),
    "rank_branch": (rank_branch, {}, (3, 2)),
}


def _inputs(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)  # values differ by rank, shapes do not
    return (torch.randn(8, 16, generator=gen), torch.randn(4, 16, generator=gen),
            torch.randn(16, generator=gen))


def _run_case(rank, world, name, codegen):
    torch.set_num_threads(1)
    fn, overrides, _ = CASES[name]
    args = _inputs(rank)
    want = eager(fn, args)
    graphs = []
    cfg = fxcoalesce.Config(codegen=codegen, strict=True, **overrides)
    be = fxcoalesce.backend(cfg, on_graph=lambda b, a, r: graphs.append((a, r)))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend=be, fullgraph=True)(*args)
    after, report = graphs[-1]
    return {"want": want, "got": got, "sequence": issue_sequence(after.graph),
            "before": report.all_reduce["before"], "after": report.all_reduce["after"]}


def check(name, results, exact: bool):
    for r in results:
        for got, want in zip(r["got"], r["want"], strict=True):
            if exact:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want)
    # the pass did rewrite these graphs as planned (else the test proves little) ...
    assert all((r["before"], r["after"]) == CASES[name][2] for r in results)
    # ... and every rank issues one sequence
    assert all(r["sequence"] == results[0]["sequence"] for r in results)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", CASES)
def test_rank_dependent_graphs_eager_codegen(name, world):
    res = spawn(_run_case, world, (name, "eager"), backend="gloo", timeout=300)
    check(name, res, exact=world == 2)


@pytest.mark.parametrize("name", [
    pytest.param("two_buckets_swap", marks=pytest.mark.slow), "rank_branch"])
def test_rank_dependent_graphs_inductor(name):
    res = spawn(_run_case, 2, (name, "inductor"), backend="gloo", timeout=300)
    check(name, res, exact=False)  # Inductor may fuse the bias add differently from eager


def dependency_differs(x, y, bias):
    """Rank 0 feeds the first sum into the second, the others do not: rank 1 fuses the two
    sums and rank 0 cannot. The passes see one rank's graph only; check_ranks must catch it.
    (A max first: a graph's first all_reduce carries the run-time check, joins no bucket.)"""
    head = ar(y, "max")
    a = ar(x * 2)
    b_in = a * 3 if dist.get_rank() == 0 else x * 3
    return head, a, ar(b_in)


def _checked_run(rank, world, name, use_env):
    import os

    torch.set_num_threads(1)
    fn = dependency_differs if name == "dependency_differs" else CASES[name][0]
    if use_env:
        os.environ["FXCOALESCE_CHECK_RANKS"] = "1"
    cfg = fxcoalesce.Config(codegen="eager", check_ranks=not use_env)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fxcoalesce.backend(cfg), fullgraph=True)
    try:
        with torch.no_grad():
            got = compiled(*_inputs(rank))
    except fxcoalesce.CollectiveMismatchError as e:
        return {"error": str(e)}
    return {"got": got, "want": eager(fn, _inputs(rank))}


def test_check_ranks_names_the_first_difference():
    res = spawn(_checked_run, 2, ("dependency_differs", False), backend="gloo", timeout=300)
    # every rank raises before running a single data collective, naming the first difference
    for r in res:
        assert "error" in r, r
        assert "collective #1: rank 0 issues all_reduce(sum, 0) -> float32[8, 16]" in r["error"]
        assert "rank 1 issues all_reduce(sum, 0) -> float32[256]" in r["error"]


@pytest.mark.parametrize("name", [
    pytest.param("sum_bias_then_max", marks=pytest.mark.slow), "rank_branch"])
def test_check_ranks_passes_rank_dependent_compute(name):
    res = spawn(_checked_run, 3, (name, True), backend="gloo", timeout=300)
    for r in res:  # turned on by FXCOALESCE_CHECK_RANKS=1: same sequences, right values
        assert "got" in r, r
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want)


def slack_differs(x, y, bias):
    """Rank 0 has much compute that can hide the first large all_reduce but must come before
    the second one's input; rank 1 has none. The cost model keeps the pair separate on rank 0
    (merged, the first would wait for the compute) and merges it on rank 1. The backend's
    first call must notice, and every rank fall back to merging."""
    head = ar(y, "max")  # the graph's first all_reduce carries the check: in no bucket
    ra = ar(x.repeat(64, 64))                         # 512 x 1024 floats: 2 MiB
    h = y
    if dist.get_rank() == 0:
        for _ in range(40):
            h = torch.tanh(h @ h.t() @ h) + bias
    rb = ar((x * 3 + h.sum()).repeat(64, 64))
    return head, ra, rb


def _slack_run(rank, world):
    from fxcoalesce.config import CostModel

    torch.set_num_threads(1)
    reports = []
    # matmuls cost 50 µs each and copies nothing: only the loop can hide an all_reduce
    cfg = fxcoalesce.Config(codegen="eager", cost=CostModel(kernel_us=50.0, memory_gbps=1e6))
    torch._dynamo.reset()
    be = fxcoalesce.backend(cfg, on_graph=lambda b, a, r: reports.append(r))
    got = torch.compile(slack_differs, backend=be, fullgraph=True)(*_inputs(rank))
    return {"got": got, "want": eager(slack_differs, _inputs(rank)),
            "choices": [[d["chose"] for d in r.decisions if d["pass"] == "bucket"]
                        for r in reports],
            "agreement": [r.agreement for r in reports],
            "after": [r.all_reduce["after"] for r in reports]}


def test_ranks_agree_on_cost_model_choices():
    res = spawn(_slack_run, 2, (), backend="gloo", timeout=300)
    # the local choices differed (rank 0 kept the pair apart, rank 1 merged it: the first
    # difference the agreement names) ...
    for r in res:
        [agreement] = r["agreement"]
        assert agreement["how"] == "fell back", agreement
        assert agreement["step"] == "without the choices that read compute"
        assert "rank 0 issues all_reduce(sum, 0) -> float32[512, 1024] <- #1" in (
            agreement["differences"][0])
    # ... so both compiled with every group merged, and computed the right values
    assert [r["choices"] for r in res] == [[["merge all"]], [["merge all"]]]
    assert [r["after"] for r in res] == [[2], [2]]
    for r in res:
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want)


def own_row_after_reduce(x, y, bias):
    """Each rank keeps its own row of a reduction (a hand-written reduce-scatter). Reducing
    only the selected row would sum different rows on different ranks: the backend's first
    call must see the slices differ and fall back to the unsliced graph."""
    return (ar(x * 2)[dist.get_rank()],)


def last_row_after_reduce(x, y, bias):
    """The same slice on every rank (last-token style): reduced sliced, and agreed on (after
    a first all_reduce, which carries the run-time check and is never sliced)."""
    return ar(y, "max"), ar(x * 2)[-1]


def _slice_run(rank, world, name):
    torch.set_num_threads(1)
    fn = {"own": own_row_after_reduce, "last": last_row_after_reduce}[name]
    reports = []
    torch._dynamo.reset()
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager"),
                            on_graph=lambda b, a, r: reports.append(r))
    got = torch.compile(fn, backend=be, fullgraph=True)(*_inputs(rank))
    return {"got": got, "want": eager(fn, _inputs(rank)),
            "bytes_after": [r.all_reduce["bytes_after"] for r in reports]}


def test_rank_dependent_slice_falls_back():
    res = spawn(_slice_run, 2, ("own",), backend="gloo", timeout=300)
    for r in res:  # the ranks' slices differ: every rank compiles it unsliced (512 B)
        assert r["bytes_after"] == [512]
        torch.testing.assert_close(r["got"][0], r["want"][0])


def test_rank_invariant_slice_stays_sliced():
    res = spawn(_slice_run, 2, ("last",), backend="gloo", timeout=300)
    for r in res:
        assert r["bytes_after"] == [256 + 64]  # the max of y, and the last row of the sum
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want)


# --- issue 14 §1: what a rewrite reads can differ between ranks, while the program's own
# collective sequence is the same. Every route compares and falls back together. ---

def const_after_wait(x, y, bias):
    """One rank adds a constant to an all_reduce's result before it is summed with another's:
    linearity sums AR(a * 0.5) + AR(x) on rank 0 but not on rank 1 (the add reads c + 1 there),
    so the ranks' buckets differ (before: CollectiveMismatchError, or gloo aborting)."""
    a = ar(x * 3)
    b = ar(a * 0.5)
    c = ar(x)
    if dist.get_rank() == 1:
        c = c + 1.0
    return b + c, ar(x * 2.0)


def dependency_by_rank(x, y, bias):
    """A branch on the rank makes the second all_reduce read the first on rank 0 only: rank 1
    buckets the two, rank 0 cannot (before: every route hung until gloo's timeout)."""
    a, b = x * 2, x * 3
    c = ar(a * 3)
    src = c * 2 if dist.get_rank() == 0 else b * 2
    return c, ar(src)


ROUTES = ("backend", "merge-all", "inductor_pass")
AGREED_STEP = {"const_after_wait": "without the choices that read compute",
               "dependency_by_rank": "in the program's own collective order"}


def _route_run(rank, world, name, route):
    torch.set_num_threads(1)
    fn = {"const_after_wait": const_after_wait, "dependency_by_rank": dependency_by_rank}[name]
    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    if route == "inductor_pass":
        torch._inductor.config.post_grad_custom_post_pass = fxcoalesce.inductor_pass()
        compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    else:
        cfg = fxcoalesce.Config(codegen="eager", slack_aware=route == "backend")
        compiled = torch.compile(fn, backend=fxcoalesce.backend(cfg), fullgraph=True)
    with torch.no_grad():
        got = compiled(*_inputs(rank))
    [report] = fxcoalesce.reports()
    return {"got": got, "want": eager(fn, _inputs(rank)), "agreement": report.agreement,
            "after": report.all_reduce["after"]}


@pytest.mark.parametrize("name,route", [  # every route once, the second program on the
    pytest.param(name, route, marks=pytest.mark.slow if name == "dependency_by_rank" and route
                 != "backend" else ()) for name in AGREED_STEP for route in ROUTES])
def test_ranks_fall_back_together(name, route):  # backend only in the default run
    res = spawn(_route_run, 2, (name, route), backend="gloo", timeout=300)
    for r in res:
        # the ranks compared, saw the difference, and took the same fallback step (a rank
        # with nothing to rewrite at any step issues the program's order without waiting) ...
        assert r["agreement"]["compared"] and r["agreement"]["step"] == AGREED_STEP[name], r
        assert r["agreement"]["how"] == "no wait" or len(r["agreement"]["differences"]) >= 1
        # ... so they pair the same collectives and compute what eager computes
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want)
    assert res[0]["after"] == res[1]["after"]
