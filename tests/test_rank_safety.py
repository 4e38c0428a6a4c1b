"""Tier 3 (issue 32): the four kinds of program that plain ``torch.compile`` runs right and
fxcoalesce once did not, on real gloo ranks with short group timeouts. Each must give right
values on every rank at every step, with no process killed and no wait near the group's
timeout (``tests/test_fuzz_ranks.py`` draws many more programs of these kinds).

1. a flag every rank reads, set on one rank only, after the ranks compiled the function cut
   two ways (float16, 4 ranks, a summed pair and an all_gather): the tag ids once collided;
2. rank-0 logging every second step between mergeable all_reduces; eager collectives
   between compiled calls; ``torch.compiler.disable`` on one rank: tags on graphs of the
   program's order once met untagged eager collectives (a gloo size abort);
3. a loop over layers with a print on rank 0: Dynamo skips the frame there, and rank 1 once
   waited for rank 0's proposal until the group's timeout;
4. a process group made anew, smaller: the check once expected the old world size.
"""

from __future__ import annotations

import datetime
import logging
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import fxcoalesce
import fxcoalesce.ranks.hooks
from fxcoalesce.apps.launch import spawn
from test_job_life import ar, logs_every_second_step, waited  # shared with the job's life

GROUP_TIMEOUT_S = 40


def close(got, want, tol=1e-5) -> bool:
    return all(torch.allclose(g.float(), w.float(), rtol=tol, atol=tol)
               for g, w in zip(got, want, strict=True))


def compiled(fn, **cfg):
    return torch.compile(fn, backend=fxcoalesce.backend(fxcoalesce.Config(codegen="eager",
                                                                          **cfg)))


def run_steps(f, fn, make_args, n: int, before=None, tol=1e-5) -> list:
    """Per step: True where ``f`` (compiled ``fn``) equals ``fn`` run eagerly, else what it
    returned wrong, or the error it raised (and the steps stop). A wait as long as the
    group's timeout shows here too: the peer's collective fails with gloo's timeout."""
    out = []
    with torch.no_grad():
        for step in range(n):
            if before is not None:
                before(step)
            args = make_args(step)
            want = waited(fn(*args))
            t0 = time.monotonic()
            try:
                got = waited(f(*args))
            except Exception as e:  # noqa: BLE001 (what the test reports)
                said = f"{type(e).__name__}: {e}"
                said = said if len(said) <= 450 else f"{said[:300]} ... {said[-150:]}"
                out.append(f"{said} [raised after {time.monotonic() - t0:.1f} s]")
                break
            out.append(True if close(got, want, tol) else f"wrong at step {step}")
    return out


def stopped_at_once(said: str) -> bool:
    """A peer of the rank that stopped stopped at once, on its own tag check (the stopped
    rank sent the reserved id where the tag goes), not on gloo's timeout."""
    after = float(re.search(r"\[raised after ([\d.]+) s\]$", said).group(1))
    return after < 0.75 * GROUP_TIMEOUT_S and "a peer issued another collective" in said


# --- 1. a flag one rank sets, after the function was compiled cut two ways ---

class _Cfg:
    verbose = False


CFG = _Cfg()


def flagged(a, b, c, d):
    p = ar(a) + ar(b)
    q = funcol.all_gather_tensor(p[:1].contiguous(), 0, dist.group.WORLD)
    y = ar(c)
    if CFG.verbose:
        print("verbose", flush=True)
    z = ar(d)
    return p, q, y + z


def _flag_run(rank, world):
    torch.set_num_threads(1)
    f = compiled(flagged)
    gen = torch.Generator().manual_seed(rank)
    args = [torch.randn(4, 8, generator=gen).half() for _ in range(4)]
    # verbose on every rank at step 0, off at step 1, on rank 0 alone at step 2
    flags = {0: True, 1: False, 2: rank == 0, 3: False}
    return run_steps(f, flagged, lambda s: args, 4,
                     before=lambda s: setattr(CFG, "verbose", flags[s]), tol=2e-2)


def test_a_flag_one_rank_sets_after_two_cuts_is_right_on_4_ranks():
    res = spawn(_flag_run, 4, (), backend="gloo", timeout=600,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(r == [True] * 4 for r in res), res


# --- 2. logging every second step; eager collectives between calls; disable on one rank ---

def first_part(x, y):
    if dist.get_rank() == 0:
        print("rank 0 logs", flush=True)
    return ar(x * 2) + ar(y * 3)


def second_part(x, y):
    return ar(x - 1) + ar(y + 1)


def between_calls(first=first_part, second=second_part):
    """Two functions (compiled or not) with eager collectives between their calls."""
    def step_fn(x, y, step):
        h = first(x, y)
        loss = h.sum().reshape(1).clone()
        dist.all_reduce(loss)
        metric = torch.tensor([float(step)])
        dist.broadcast(metric, 0)
        return second(h, y) + loss + metric
    return step_fn


@torch.compiler.disable
def row_parallel_eager(x):
    return ar(x * 3)


def row_parallel(x):
    return ar(x * 3)


def with_disabled_helper(x, y, step):
    helper = row_parallel_eager if dist.get_rank() == 0 else row_parallel
    return ar(x * 2) + helper(y)


def _part2_run(rank, world, which):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)

    def fresh(step):
        return torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen), step

    if which == "between":
        return run_steps(between_calls(compiled(first_part), compiled(second_part)),
                         between_calls(), fresh, 4)
    fn = {"logging": logs_every_second_step, "disable": with_disabled_helper}[which]
    return run_steps(compiled(fn), fn, fresh, 4)


@pytest.mark.parametrize("which", ["logging", "between", "disable"])
def test_what_plain_runs_right_runs_right(which):
    res = spawn(_part2_run, 2, (which,), backend="gloo", timeout=400,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(r == [True] * 4 for r in res), res


# --- 3. a loop over layers with a print on rank 0: Dynamo skips the frame there ---

def layers(x, ws, step):
    for w in ws:  # parallel blocks: two all_reduces a layer, summed
        x = x + ar(x @ w) + ar(x * 2)
        if dist.get_rank() == 0 and step % 50 == 0:
            print(f"step {step}", flush=True)
    return x


def _loop_run(rank, world):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 8, generator=gen) * 0.1 for _ in range(3)]
    f = compiled(layers)
    out = run_steps(f, layers, lambda s: (torch.ones(4, 8) * (rank + 1), ws, s), 60)
    return out, [r.agreement.get("how") for r in fxcoalesce.reports()]


def test_a_frame_dynamo_skips_on_one_rank_does_not_wait_for_the_timeout():
    res = spawn(_loop_run, 2, (), backend="gloo", timeout=400,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(r[0] == [True] * 60 for r in res), res
    # rank 1 compiled the unrolled loop and stopped waiting for rank 0 as soon as rank 0,
    # which skipped the frame, issued its collectives another way (uncompiled, or in a
    # graph of its own for each call of ar)
    assert {"runs uncompiled", "cut differently"} & set(res[1][1]), res


# --- 4. a process group made anew, smaller ---

def pair(x, y):
    return ar(x * 2) + ar(y * 3)


def _smaller_run(rank, world, path):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    f = compiled(pair)
    out = run_steps(f, pair, lambda s: (x, y), 2)
    dist.destroy_process_group()
    if rank >= 2:
        return out + ["left"]
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return out + run_steps(f, pair, lambda s: (x, y), 2)


def test_a_smaller_group_made_anew_runs_right(tmp_path):
    res = spawn(_smaller_run, 4, (str(tmp_path / "store"),), backend="gloo", timeout=600,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert res[0] == res[1] == [True] * 4, res
    assert res[2] == res[3] == [True, True, "left"], res


# --- outside, loudly: the recompile limit reached on one rank for a rewritten function ---

def scaled(x, y, s):
    return ar(x * s) + ar(y * 3)


def _limit_run(rank, world, hook="auto"):
    torch.set_num_threads(1)
    fxcoalesce.ranks.hooks.SKIP_HOOK = hook
    torch._dynamo.config.recompile_limit = 2
    torch._dynamo.config.automatic_dynamic_shapes = False  # s stays a constant: recompiles
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    f = compiled(scaled)
    # every rank reads s (the same guards), only rank 0 changes it: rank 0 alone recompiles
    out = run_steps(f, scaled, lambda s: (x, y, float(s + 1) if rank == 0 else 1.0), 4)
    return out, [r.all_reduce["after"] for r in fxcoalesce.reports()]


@pytest.mark.parametrize("hook", ["auto", pytest.param("call", marks=pytest.mark.slow)])
def test_the_recompile_limit_on_one_rank_for_a_rewrite_stops_every_rank_at_once(hook):
    """``call``: Dynamo heard at ``CatchErrorsWrapper.__call__``, as on torch 2.11 (found by
    the fuzzer on the GPU machine, seeds 50008 and 50019: rank 1 got gloo's "Connection closed
    by peer" where rank 0 stopped without sending it anything). Rank 0 stops at the first
    collective of its uncompiled run, its peer on its own check there."""
    res = spawn(_limit_run, 2, (hook,), backend="gloo", timeout=400,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert res[1][1][0] == 1, res  # the ranks agreed to sum the pair
    for steps, _ in res:  # right until rank 0 would run it uncompiled, then a clear error
        assert steps[:2] == [True, True] and len(steps) == 3, res
        assert steps[2].startswith("CollectiveMismatchError"), res
    assert "recompile_limit" in res[0][0][2], res
    assert stopped_at_once(res[1][0][2]), res


# --- a rewritten function that Dynamo, at a recompile, skips or compiles only in part ---

USER_LOG = logging.getLogger("a_user")


def looped(x, ws, step):
    """A logger call (Dynamo cannot move it past the graph, as it moves a print at a
    rewritten function's recompile: test_job_life) in a loop: Dynamo skips the frame."""
    for w in ws:
        x = torch.tanh(ar(x @ w) + ar(x * 2))
        if CFG.verbose:
            USER_LOG.warning("verbose")
    return x


def looped_partly(x, ws, step):
    """The print formats ``step``, an int Dynamo made dynamic at step 1: at the recompile
    torch 2.13's Dynamo compiles up to the loop and runs the rest uncompiled (a graph break
    it cannot resume from; 2.15's skips the frame)."""
    x = torch.relu(x) + step  # read: Dynamo makes step dynamic at step 1
    for w in ws:
        x = torch.tanh(ar(x @ w) + ar(x * 2))
        if CFG.verbose:
            USER_LOG.warning("verbose at step %d", step)
    return x


def looped_c10d(x, ws, step):
    """``looped`` with ``dist.all_reduce`` in place: where Dynamo runs it uncompiled, the
    watched call goes through ``dist``'s own function, not the functional op."""
    for w in ws:
        a, b = x @ w, x * 2
        dist.all_reduce(a)
        dist.all_reduce(b)
        x = torch.tanh(a + b)
        if CFG.verbose:
            USER_LOG.warning("verbose")
    return x


def _skip_run(rank, world, who, fn, hook="auto"):
    torch.set_num_threads(1)
    fxcoalesce.ranks.hooks.SKIP_HOOK = hook  # "call": where Dynamo has no _handle_skip
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 8, generator=gen) * 0.1 for _ in range(2)]
    fn = {"looped": looped, "looped_partly": looped_partly, "looped_c10d": looped_c10d}[fn]
    f = compiled(fn)
    on = {"one": rank == 0, "all": True}[who]  # verbose from step 2 on: rank 0, or all
    out = run_steps(f, fn, lambda s: (torch.ones(4, 8) * (rank + s + 1), ws, s), 4,
                    before=lambda s: setattr(CFG, "verbose", on and s >= 2))
    return out, [r.all_reduce["after"] for r in fxcoalesce.reports()]


@pytest.mark.parametrize("fn,hook", [("looped", "auto"), ("looped_partly", "auto"),
                                     ("looped", "call"), ("looped_c10d", "auto"),
                                     pytest.param("looped_partly", "call", marks=pytest.mark.slow)])
def test_a_skip_at_a_recompile_on_one_rank_stops_every_rank_at_once(fn, hook):
    """``call``: Dynamo's results heard at ``CatchErrorsWrapper.__call__``, as on torch 2.11,
    whose Dynamo has no ``_handle_skip`` (there rank 0 ran the frame uncompiled and gloo
    aborted both ranks: found on the GPU machine, which has 2.11)."""
    res = spawn(_skip_run, 2, ("one", fn, hook), backend="gloo", timeout=400,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert res[1][1][0] < 4, res  # the ranks agreed to sum the pairs
    for steps, _ in res:  # right until rank 0 would run the frame uncompiled, then loud
        assert steps[:2] == [True, True] and len(steps) == 3, res
        assert steps[2].startswith("CollectiveMismatchError"), res
    # torch 2.13 compiles looped_partly up to the loop, 2.15 skips its frame: either is seen
    assert f"rank 0 runs {fn} uncompiled here" in res[0][0][2], res
    assert "a peer runs the rewritten graph" in res[0][0][2], res
    assert stopped_at_once(res[1][0][2]), res


@pytest.mark.parametrize("fn", [pytest.param("looped", marks=pytest.mark.slow),
                                "looped_partly"])
def test_a_skip_at_a_recompile_on_every_rank_runs_right(fn):
    res = spawn(_skip_run, 2, ("all", fn), backend="gloo", timeout=400,
                group_timeout_s=GROUP_TIMEOUT_S)
    assert all(steps == [True] * 4 for steps, _ in res), res


def test_the_registered_name_hears_dynamo_before_any_graph():
    """``torch.compile(fn, backend="fxcoalesce")`` hears Dynamo from the call on, as
    ``fxcoalesce.backend()`` does: a frame skipped before any graph compiles is heard (fuzz
    seed 550111: a peer waited half the group's timeout for a proposal that never came)."""
    import subprocess
    import sys

    code = ("import torch, fxcoalesce.ranks.hooks as h; assert not h._WATCHED; "
            "torch.compile(lambda x: x + 1, backend='fxcoalesce'); print(bool(h._WATCHED))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_rank_whose_store_went_away_compiles_the_programs_order():
    """Fuzz seed 560015: the rank that hosts the store ended (its half of the job done) while
    this rank agreed, and the store's I/O raised ``DistNetworkError``. No decision can be read:
    the program's own order, untagged; where this rank runs the function rewritten, carrying
    the reserved tag (a peer still running the rewrite stops with it rather than mispairing)."""
    from fxcoalesce.ranks.agreement import RankEnv, agree_graph, ladder
    from fxcoalesce.ranks.store import RESERVED_ID, Store

    class Gone:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was "
                                            "likely closed.")
            return fail

    cfg = fxcoalesce.Config(agree_timeout_s=60)
    steps = ladder(cfg)
    program = [("0", "all_reduce(f32[8], 'sum', 0)")] * 2
    sequences = [[("0", "all_reduce(f32[16], 'sum', 0)")]] * (len(steps) - 1) + [program]
    env = RankEnv(Store(Gone(), 1, "t"), members=lambda g: [0, 1], position=lambda g: 0)

    def agree():
        return agree_graph("g", cfg, steps, program, sequences, [0] * len(steps),
                           check_ranks=False, frame="f@x.py:1", env=env)

    out = agree()
    assert (out.step, out.agreement.how, out.tagged) == (len(steps) - 1, "store gone", False)
    env.rewritten.add("f@x.py")
    out = agree()
    assert (out.step, out.tagged, out.tag) == (len(steps) - 1, True, RESERVED_ID)


def test_a_peer_that_cut_the_function_before_any_collective_ends_the_wait_at_once():
    """Fuzz seed 590065 (4 ranks): rank 0 calls a disabled ``mix`` (an all_reduce on its half of
    the world) first, so its graph of ``step_fn`` ends before any collective, and it then waits
    in that eager all_reduce for rank 1, which waits to agree on its whole ``step_fn``. Rank
    0's note says where it compiled ``step_fn``; rank 1's graph also runs over a group rank 0
    is not in (the strided half {1, 3}), which the note cannot place and must not count:
    rank 1 reads "cut differently" at once, not after half the group's timeout (20 s)."""
    from torch.distributed import HashStore

    from fxcoalesce.ranks.agreement import RankEnv, agree_graph, ladder
    from fxcoalesce.ranks.store import Store

    groups = {"world": [0, 1, 2, 3], "halves": [0, 1], "strided": [1, 3]}
    store = HashStore()
    Store(store, 0, "t").note({"fam": "step_fn@p.py", "how": "compiled",
                               "pos": {"world": 0, "halves": 0, "other": 0}})
    cfg = fxcoalesce.Config(agree_timeout_s=30)
    steps = ladder(cfg)
    program = [(g, f"all_reduce(f32[8], 'sum', {g})") for g in groups]
    merged = [program[0], ("strided", "all_reduce(f32[16], 'sum', strided)")]
    env = RankEnv(Store(store, 1, "t"), members=groups.__getitem__, position=lambda g: 0,
                  timeout=lambda g: None)
    t0 = time.monotonic()
    out = agree_graph("g", cfg, steps, program, [merged] * (len(steps) - 1) + [program],
                      [0] * len(steps), check_ranks=False, frame="step_fn@p.py:3", env=env)
    assert (out.agreement.how, out.step) == ("cut differently", len(steps) - 1), out.agreement
    assert time.monotonic() - t0 < 5
