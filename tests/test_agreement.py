"""Tier 3 (issue 20): ranks that compile different graphs, at different times, on several
groups, with sizes named differently, agree without a collective at compile time: no hang,
values equal plain execution, and SPMD programs keep their rewrites.

Every case runs on real gloo ranks with a short group timeout (a collective that never pairs
fails in a minute) and a short ``agree_timeout_s`` where a wait is expected. Each program
starts with an all_reduce of its own (``lead``): a graph's first all_reduce carries the
run-time check and joins no bucket (issue 25), so the pairs after it are what merges.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import fxcoalesce
from fxcoalesce.apps.launch import RankError, spawn

GROUP_TIMEOUT_S = 60
"""Long enough for a peer's Inductor compile on a loaded 2-core machine (a rank waits in its
first collective while its peer compiles, as with plain torch.compile), short enough that a
hang fails in a minute, not in gloo's default 30."""


def ar(x, group=None):
    return funcol.all_reduce(x, "sum", group or dist.group.WORLD)


def lead(x, group=None):
    """The graph's first all_reduce (a max: never summed or bucketed with the sums)."""
    return funcol.all_reduce(x, "max", group or dist.group.WORLD)


def waited(out):
    return tuple(t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t for t in out)


def inputs(rank: int):
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen)


def compiled(fn, route: str, **cfg):
    torch._dynamo.reset()
    fxcoalesce.clear_reports()
    if route == "inductor_pass":
        torch._inductor.config.post_grad_custom_post_pass = fxcoalesce.inductor_pass(
            fxcoalesce.Config(**cfg))
        return torch.compile(fn, backend="inductor")
    codegen = "inductor" if route == "inductor" else "eager"
    return torch.compile(fn, backend=fxcoalesce.backend(fxcoalesce.Config(codegen=codegen,
                                                                          **cfg)))


def summary(got, want) -> dict:
    return {"equal": all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want,
                                                                          strict=True)),
            "agreement": [r.agreement for r in fxcoalesce.reports()],
            "after": [r.all_reduce["after"] for r in fxcoalesce.reports()]}


# --- §1: a print on one rank cuts its graph in two ---

def logs_on_rank0(x, w):
    c = lead(x)
    a = ar(x @ w)
    if dist.get_rank() == 0:
        print("rank 0: a step", flush=True)
    b = ar(x * 2)
    return c, a + 1, b - 1


def _print_run(rank, world, route, check):
    torch.set_num_threads(1)
    x, w = inputs(rank)
    with torch.no_grad():
        want = waited(logs_on_rank0(x, w))
        f = compiled(logs_on_rank0, route, agree_timeout_s=60, check_ranks=check)
        t0 = time.monotonic()
        got = waited(f(x, w))
    return {**summary(got, want), "s": time.monotonic() - t0}


@pytest.mark.parametrize("route,check", [  # Inductor on 2 ranks: 50-90 s each, slow (the
    ("eager", False), ("eager", True),     # default run has test_job_life's Inductor cases)
    pytest.param("inductor", False, marks=pytest.mark.slow),
    pytest.param("inductor_pass", False, marks=pytest.mark.slow)])
def test_a_print_on_one_rank_runs_like_plain(route, check):
    res = spawn(_print_run, 2, (route, check), backend="gloo", timeout=300,
                group_timeout_s=GROUP_TIMEOUT_S)
    r0, r1 = res
    assert r0["equal"] and r1["equal"]
    # rank 0 has two graphs, rank 1 one graph of all three: rank 1 sees rank 0 compile
    # another graph at the same place and both ranks keep the program's order ...
    assert r0["after"] == [2, 1] and r1["after"] == [3]
    assert r1["agreement"][0]["how"] == "cut differently", r1
    # ... at once: neither waited out the 60 s agree_timeout_s (how each wait ended, not a
    # wall time, which a loaded machine stretches)
    assert all(a.get("how") != "timed out" for r in res for a in r["agreement"]), res


# --- §1: a recompile on one rank only, while the peer already runs the graph ---

SCALE = {"value": 1.0}


def scaled(x, w):
    return lead(x), ar(x * SCALE["value"]), ar(w * 2)


def _recompile_run(rank, world):
    torch.set_num_threads(1)
    x, w = inputs(rank)
    f = compiled(scaled, "eager", agree_timeout_s=60)
    outs = []
    with torch.no_grad():
        for call in range(3):
            if rank == 1 and call == 1:
                SCALE["value"] = 0.5  # dynamo guards on it: rank 1 alone recompiles
            want = waited(scaled(x, w))
            outs.append(summary(waited(f(x, w)), want))
    return outs


def test_a_recompile_on_one_rank_keeps_the_agreed_rewrite():
    res = spawn(_recompile_run, 2, (), backend="gloo", timeout=300,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(o["equal"] for r in res for o in r)
    # rank 0 compiled once, rank 1 twice; every graph merges the two sums
    assert res[0][-1]["after"] == [2] and res[1][-1]["after"] == [2, 2]
    hows = [a["how"] for a in res[1][-1]["agreement"]]
    assert hows == ["agreed", "decided before"], hows


# --- §1: one rank compiles late; a peer that never compiles ---

def pair(x, w):
    return lead(x), ar(x * 3), ar(w - 1)


def _late_run(rank, world, late_s, rank1_eager):
    torch.set_num_threads(1)
    x, w = inputs(rank)
    with torch.no_grad():
        want = waited(pair(x, w))
        if rank == 1:
            time.sleep(late_s)
        f = compiled(pair, "eager", agree_timeout_s=30)
        if rank == 1 and rank1_eager:  # this rank runs the stretch uncompiled (a frame
            return summary(waited(pair(x, w)), want)  # Dynamo skipped there, say)
        return summary(waited(f(x, w)), want)


def test_a_late_rank_still_gets_the_rewrite():
    res = spawn(_late_run, 2, (6.0, False), backend="gloo", timeout=300,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(r["equal"] for r in res)
    assert [r["after"] for r in res] == [[2], [2]]
    assert res[0]["agreement"][0]["how"] == "agreed"


@pytest.mark.slow
def test_a_late_rank_is_waited_for():
    """The premise of the test above, a wall time (slow run only: a loaded machine stretches
    the ranks' compiles, and rank 0's can outlast rank 1's 6 s sleep): rank 0 waited."""
    res = spawn(_late_run, 2, (6.0, False), backend="gloo", timeout=300,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert [r["after"] for r in res] == [[2], [2]]
    assert res[0]["agreement"][0]["waited_s"] > 4  # it waited for rank 1, then merged


def test_a_peer_that_never_compiles_ends_the_wait_in_program_order():
    """Rank 1 runs the stretch without torch.compile at all: its first collective is issued
    while rank 0 compiles, and nothing of fxcoalesce's runs in rank 1's process to say so (no
    thread). Rank 0 waits to half the group's timeout, so the eager peer's collective is
    still there, then runs the program's own order, untagged, which pairs with it (issue 32:
    tags once made gloo abort here). A peer that Dynamo skips says so: test_rank_classes."""
    group_s = GROUP_TIMEOUT_S / 2  # the wait is half of it: 15 s, not 30, in the default run
    res = spawn(_late_run, 2, (0.0, True), backend="gloo", timeout=300, group_timeout_s=group_s)
    assert all(r["equal"] for r in res)
    [agreement] = res[0]["agreement"]
    assert agreement["how"] == "timed out", agreement
    assert agreement["waited_s"] < 0.75 * group_s, agreement
    assert res[0]["after"] == [3]  # the program's own order pairs with the eager peer


# --- §2: one order across groups ---

def _groups(world: int):
    """(A, B): on 2 ranks two groups of the same ranks; on 4, TP {0,1},{2,3} and DP {0,2},
    {1,3} (every rank calls new_group for every group, in one order)."""
    if world == 2:
        return dist.new_group([0, 1]), dist.new_group([0, 1])
    tp = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    dp = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    rank = dist.get_rank()
    return tp[rank // 2], dp[rank % 2]


GROUPS: dict = {}


def crossed(x, w):
    """Rank-dependent reads across groups: on even ranks B reads the first A all_reduce, on
    odd ranks the second A all_reduce reads B. Merging the two A's gives each rank another
    interleaving of A and B (before: every route deadlocked)."""
    a_grp, b_grp = GROUPS["A"], GROUPS["B"]
    c = lead(x, a_grp)
    a1 = ar(x * 2, a_grp)
    odd = dist.get_rank() % 2
    b = ar(w * 3 + (0 if odd else a1.mean()), b_grp)
    a2 = ar(x * 5 + (b.mean() if odd else 0), a_grp)
    return c, a1, b, a2


def _crossed_run(rank, world, check):
    torch.set_num_threads(1)
    GROUPS["A"], GROUPS["B"] = _groups(world)
    x, w = inputs(rank)
    with torch.no_grad():
        want = waited(crossed(x, w))
        f = compiled(crossed, "eager", agree_timeout_s=60, check_ranks=check)
        try:
            got = waited(f(x, w))
        except fxcoalesce.CollectiveMismatchError as e:
            return {"error": str(e)}
    return summary(got, want)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_agree_on_one_interleaving_across_groups(world):
    res = spawn(_crossed_run, world, (False,), backend="gloo", timeout=400,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(r["equal"] for r in res)
    # each group's own sequence would agree after merging; the interleaving does not: all
    # ranks keep the program's order together
    assert all(r["after"] == [4] for r in res), res
    assert all(r["agreement"][0]["how"] in ("fell back", "no wait") for r in res), res


def test_check_ranks_raises_on_every_rank_for_a_crossed_interleaving():
    res = spawn(_crossed_run, 2, (True,), backend="gloo", timeout=300,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all("error" in r for r in res), res
    assert all("would issue different collective sequences" in r["error"] for r in res)


# --- §3: sizes compared by value, not by symbol name ---

def named_by_first_input(z, x):
    """Dynamo names a size after the first input that has it: on rank 0 z is as long as x,
    so x's length is named after z there and not on rank 1."""
    return lead(x), ar(x * 2), ar(x * 3), z + 1


def _dynamic_run(rank, world, check):
    torch.set_num_threads(1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    z = torch.randn(6 if rank == 0 else 5)
    torch._dynamo.reset()
    fxcoalesce.clear_reports()
    cfg = fxcoalesce.Config(codegen="eager", agree_timeout_s=60, check_ranks=check)
    f = torch.compile(named_by_first_input, backend=fxcoalesce.backend(cfg), dynamic=True)
    with torch.no_grad():
        want = waited(named_by_first_input(z, x))
        got = waited(f(z, x))
    return summary(got, want)


@pytest.mark.parametrize("check", [pytest.param(False, marks=pytest.mark.slow), True])
def test_sizes_named_differently_by_rank_still_agree(check):
    res = spawn(_dynamic_run, 2, (check,), backend="gloo", timeout=300,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(r["equal"] for r in res)
    assert [r["after"] for r in res] == [[2], [2]]  # merged on both: no false difference
    assert all(r["agreement"][0]["how"] == "agreed" for r in res), res


def _lonely(rank, world):
    if rank == 0:
        ar(torch.ones(2)).wait()
    return rank


def test_a_hang_fails_in_seconds_not_minutes():
    """The harness itself: a collective one rank never joins fails within the group timeout
    (what makes every test above fail fast instead of hanging)."""
    with pytest.raises(RankError) as e:
        spawn(_lonely, 2, (), backend="gloo", timeout=120, group_timeout_s=5)
    assert "no result within spawn's timeout" not in str(e.value), e.value  # the group's


# --- one function, two graphs with the same collectives (a later graph of a program key) ---

def twoways(x, w, independent: bool):
    """Dynamo specializes on ``independent``: two graphs of one function whose collectives
    look alike (the same program key); only the second pair is independent (mergeable)."""
    c = lead(x)
    a = ar(x * 2)
    b = ar((x if independent else a) * 3)
    return c, a, b


def _twoways_run(rank, world, order):
    torch.set_num_threads(1)
    x, _ = inputs(rank)
    f = compiled(twoways, "eager", agree_timeout_s=60)
    out = []
    with torch.no_grad():
        for independent in order:
            want = waited(twoways(x, x, independent))
            got = waited(f(x, x, independent))
            out.append(all(torch.allclose(g, w) for g, w in zip(got, want)))
    return {"equal": out, "after": [r.all_reduce["after"] for r in fxcoalesce.reports()],
            "how": [r.agreement.get("how") for r in fxcoalesce.reports()]}


@pytest.mark.parametrize("order", [(False, True),
                                   pytest.param((True, False), marks=pytest.mark.slow)])
def test_two_graphs_of_one_function_with_alike_collectives_each_agree(order):
    res = spawn(_twoways_run, 2, (order,), backend="gloo", timeout=300,
                group_timeout_s=GROUP_TIMEOUT_S)
    want_after = [2 if independent else 3 for independent in order]
    for r in res:
        assert all(r["equal"]) and r["after"] == want_after, r


def _dump_run(rank, world, directory):
    torch.set_num_threads(1)
    x, w = inputs(rank)
    with torch.no_grad():
        compiled(pair, "eager", agree_timeout_s=60, dump_dir=directory)(x, w)
    return rank


def test_a_dumped_report_carries_the_agreement(tmp_path):
    import json

    spawn(_dump_run, 2, (str(tmp_path),), backend="gloo", timeout=300,
          group_timeout_s=GROUP_TIMEOUT_S)
    for rank in range(2):
        [path] = (tmp_path / f"rank{rank}").glob("graph_*/report.json")
        agreement = json.loads(path.read_text())["agreement"]
        assert agreement["compared"] and agreement["how"] == "agreed", agreement
        assert agreement["ranks"] == [0, 1]
