"""Tier 3, rank safety: generated programs on real gloo ranks, fxcoalesce against plain
``torch.compile`` (tests/fuzz: the generator, the runner, the oracle, record and replay).

Default run: three of the seventeen fixed seeds on 2 ranks (DEFAULT: a flag one rank sets
and a print inside a layer loop; a collective disabled on one rank; two threads with their
own groups) and the generator's and the oracle's own checks (no ranks); 10-30 s a seed
while fxcoalesce passes them (a hang costs the 30 s group timeout more). The recorded
failures under tests/data/fuzz/ replay in CI's part 4 (each one's first variant, against
plain; RECENT ones in the default run too) and, every variant, in the slow run.
Slow run (``-m slow``): the other fourteen fixed seeds (together the seventeen draw every
feature of the grammar but the long runs and Inductor; about 3.5 minutes for the first nine,
1.5-2.5 more for issue 49's eight, on 2 shared cores) and FXCOALESCE_FUZZ_N fresh programs
(default 500; FXCOALESCE_FUZZ_SEED fixes the first seed, FXCOALESCE_FUZZ_JOBS runs programs
side by side):

    pytest tests/test_fuzz_ranks.py
    FXCOALESCE_FUZZ_N=50 pytest -m slow tests/test_fuzz_ranks.py -s
"""

from __future__ import annotations

import collections
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from fuzz import oracle, record
from fuzz.gen import default_world, generate

GROUP_TIMEOUT_S = 30

# (seed, what it draws): one program per feature class (the rank-dependent ones apart, so
# that one failure does not hide another), together every feature of the grammar but the
# long runs and Inductor (the slow run draws those). The first nine draw none of issue 49's
# classes (gen._side); the next eight one each, with no logging, disabled helper or
# recompile limit of the older grammar beside it; the last, issue 50's token split.
FIXED = {
    5937: "fp16; summed pairs and triples, buckets; avg, max, min; dynamic=True and changing "
          "lengths; a setitem KV cache; an eager all_reduce",
    3797: "bf16; sums of three reductions, buckets over three groups; an index_copy_ KV "
          "cache; an eager all_reduce",
    10002: "a layer loop of bucketed avg all_reduces; a print on rank 0 every 3 steps, and "
           "one inside the loop behind a flag rank 0 sets from step 2; changing lengths; an "
           "eager all_reduce",
    858: "fp16; logging on one rank inside the layer loop, through a helper, by print and "
         "logger.warning, RANK and dist.get_rank()",
    221: "a helper with an all_reduce disabled on one rank; a chain; two compiled functions",
    3396: "fp16; a compute helper disabled on one rank; a sum of reductions of mixed ops",
    270: "bf16; a recompile limit that one rank reaches; an all_gather beside an all_reduce; "
         "an eager all_reduce and broadcast",
    1296: "the process group made anew smaller (rank 1 stops); two compiled functions; eager "
          "collectives",
    570: "the process group made anew at the same size; a sum of reductions of mixed ops",
    75: "threads: two threads per rank, each with its own group and row count, calling one "
        "compiled function; buckets, an all_gather; two compiled functions",
    791: "raise: a ValueError for a bad input before any collective on one rank, caught, then "
         "the call again; fp16; an eager all_reduce",
    992: "raise: a ValueError on a flag after some collectives on every rank, caught, then the "
         "call again; bf16; a setitem KV cache; changing lengths",
    6006: "regroup_then.skip: the group made anew, then a print inside the layer loop on one "
          "rank (Dynamo skips the frame there); an index_copy_ KV cache",
    1198: "regroup_then.limit: the group made anew, then one rank changes a value each step "
          "under a recompile limit of 3 (it reaches it); avg; changing lengths",
    6505: "regroup_then.disable: the group made anew, then a compute helper disabled on one "
          "rank; an all_gather; an index_copy_ KV cache",
    5509: "regroup_then.disable_collective: the group made anew, then a helper with an "
          "all_reduce disabled on one rank; an all_gather",
    3468: "dynint: dynamic=True, 30 steps, a print on one rank every N steps (a branch on the "
          "int argument and the rank) and a branch on an int argument; fp16; a KV cache",
    2306: "split.forced (issue 50): the token split forced on, dynamic=True and changing "
          "lengths (the symbolic n // 2), an index_copy_ KV cache, a layer loop over three "
          "groups",
}


DEFAULT = {10002, 221, 75}
"""The fixed seeds of the default run (issue 32's kinds: a flag one rank sets, a print in a
loop Dynamo skips on one rank, a collective disabled on one rank; issue 49's two request
streams on threads, 8-9 s on 2 cores); the others are slow."""

KNOWN: dict[int, str] = {}
"""Fixed programs that fail today for a reason understood and written down: strict xfails,
so a fix flips them (then take them out of KNOWN)."""


def _failures(res: dict) -> dict:
    return {v: r for v, r in res["variants"].items() if r["outcome"] in oracle.FAILURES}


@pytest.mark.parametrize("seed", [
    pytest.param(s, marks=() if s in DEFAULT else pytest.mark.slow)
    for s in sorted(set(FIXED) - set(KNOWN))] + [
    pytest.param(s, marks=[pytest.mark.xfail(strict=True, reason=why)] + (
        [] if s in DEFAULT else [pytest.mark.slow])) for s, why in KNOWN.items()])
def test_a_fixed_program_on_two_ranks(seed):
    res = record.fuzz_one(generate(seed, 2, inductor=False), group_timeout=GROUP_TIMEOUT_S)
    # the fixed programs are ones plain torch.compile runs right (else they prove nothing)
    assert res["plain"]["outcome"] == "ok", res["plain"]
    # fxcoalesce, default and check_ranks=True: right on every rank at every step, or a
    # loud stop (a loud error where it saw why, that or the transport's error as the
    # stopped rank ends on every other rank); never a wrong value, a killed rank, a hang,
    # a longer wait
    assert not _failures(res), (f"seed {seed} ({FIXED[seed]}): {_failures(res)}; "
                                f"recorded in {res.get('record')}")


def _slow_only(path) -> bool:
    """A record marked ``slow_only`` (its class replays in the default run through another)."""
    return bool(json.loads(path.read_text()).get("slow_only"))


RECENT: set[str] = {"119"}
"""Replays in the default run (a fix's record while the fix is fresh). The others replay in
CI under the oldest torch (``other_torch``: .ci/run part 4, which runs this whole file
anyway) and, every variant, in the slow run; 90026, 130162 and 140124, the default run's
until 2026-12-06, cost it 57 s of its 10 minutes on 2 cores."""


def _replay_marks(p):
    if _slow_only(p):
        return pytest.mark.slow
    return () if p.stem in RECENT else pytest.mark.other_torch


@pytest.mark.parametrize("path,every", [
    pytest.param(p, False, id=p.stem, marks=_replay_marks(p))
    for p in record.replay_files()] + [
    pytest.param(p, True, id=f"{p.stem}-every", marks=pytest.mark.slow)
    for p in record.replay_files()])
def test_a_recorded_failure_replays_right(path, every):
    """Without ``-m slow`` (CI's part 4; RECENT ones in the default run too): the first
    variant recorded, judged against plain; slow run (``every``): every variant recorded,
    and plain against eager."""
    prog, rec = record.load(path)
    variants = tuple(rec["variants"]) if every else tuple(rec["variants"])[:1]
    res = record.fuzz_one(prog, variants, eager=every, group_timeout=rec["group_timeout"])
    assert res["plain"]["outcome"] == "ok", res["plain"]
    assert not _failures(res), (path.name, _failures(res), f"recorded in {res.get('record')}")


def test_the_generator_is_deterministic_and_draws_the_whole_grammar():
    assert generate(1257, 2).text == generate(1257, 2).text
    assert generate(1257, 2).text != generate(1257, 4).text
    drawn = collections.Counter()
    for seed in range(400):
        prog = generate(seed, default_world(seed))
        compile(prog.text, f"seed {seed}", "exec")  # every program is valid Python
        drawn.update(prog.features)
    grammar = {f"tp.{k}" for k in ("sum", "sum3", "bucket", "chain", "gather", "loop",
                                   "mixed_op")} | \
        {f"op.{k}" for k in ("avg", "max", "min")} | \
        {f"dtype.{k}" for k in ("float32", "float16", "bfloat16")} | \
        {f"groups.{k}" for k in (1, 2, 3)} | \
        {f"log.{k}" for k in ("rank", "every_n", "loop", "helper", "flag", "logging",
                              "get_rank")} | \
        {"eager.all_reduce", "eager.broadcast", "disable.compute", "disable.collective",
         "recompile.limit", "dynamic.seq", "dynamic.true", "kv.setitem", "kv.index_copy",
         "regroup.same", "regroup.smaller", "steps.many", "steps.long", "compile.inductor",
         "compile.two_fns", "split.forced"} | ISSUE_49
    assert grammar <= set(drawn), grammar - set(drawn)
    fixed = set().union(*(generate(s, 2, inductor=False).features for s in FIXED))
    assert grammar - fixed == {"steps.long", "compile.inductor"}, grammar - fixed


ISSUE_49 = {"threads.two_groups", "raise.before", "raise.after", "raise.one_rank",
            "raise.every_rank", "regroup_then.skip", "regroup_then.limit",
            "regroup_then.disable", "regroup_then.disable_collective", "dynint.rank_every",
            "dynint.int_branch"}


def test_issue_49s_classes_leave_the_other_seeds_as_they_were(monkeypatch):
    """The classes draw from a second generator (gen._side): a seed that draws none gives
    the program it gave before them, among them the first nine fixed seeds; one that draws
    a ValueError class keeps every other feature the program drew (the other classes take
    from a thread's streams what they cannot share: G1, G2, a KV cache, a group made anew;
    more steps)."""
    from fuzz import gen

    first = [5937, 3797, 10002, 858, 221, 3396, 270, 1296, 570]
    assert not any(gen._side(s)[1] for s in first)
    assert all(gen._side(s)[1] for s in set(FIXED) - set(first) - {2306})
    share = sum(bool(gen._side(s)[1]) for s in range(2000)) / 2000
    assert 0.1 < share < 0.3, share
    seeds = [s for s in range(400) if gen._side(s)[1] == {"raise"}]
    assert len(seeds) > 10, seeds
    progs = {s: generate(s, 2, inductor=False) for s in seeds}
    side = gen._side
    monkeypatch.setattr(gen, "_side", lambda s: (side(s)[0], set()))
    for seed, prog in progs.items():
        without = generate(seed, 2, inductor=False)
        assert not set(without.features) & ISSUE_49
        assert set(prog.features) - set(without.features) <= ISSUE_49, seed
        assert set(without.features) <= set(prog.features), seed


@pytest.mark.slow
def test_fresh_programs():
    n = record.env_int("FXCOALESCE_FUZZ_N", 500)
    base = record.env_int("FXCOALESCE_FUZZ_SEED", random.SystemRandom().randrange(2**31))
    print(f"fuzz: seeds {base}..{base + n - 1} (FXCOALESCE_FUZZ_SEED={base} replays them)")
    progs = [generate(s, default_world(s)) for s in range(base, base + n)]
    with ThreadPoolExecutor(record.env_int("FXCOALESCE_FUZZ_JOBS", 1)) as pool:
        results = list(pool.map(lambda p: record.fuzz_one(p, group_timeout=40), progs))
    counts = collections.Counter(v["outcome"] for r in results for v in r["variants"].values())
    print(f"fuzz: {dict(counts)}; plain: "
          f"{dict(collections.Counter(r['plain']['outcome'] for r in results))}")
    bad = [(r["seed"], v, x["outcome"], x["detail"][:200]) for r in results
           for v, x in _failures(r).items()]
    assert not bad, bad


def test_the_oracle_allows_a_sum_the_rounding_of_its_terms():
    """Seed 70072: a float32 loss summed from float16 outputs over 4 ranks (terms of total
    size 139) moved by 0.045 when fxcoalesce reassociated sums inside; each output was
    within its tolerance. A wrong pairing moves such a sum by the size of its terms."""
    want = ["float32", [1], [0.459], 139.0]
    assert oracle.close(["float32", [1], [0.414], 139.0], want, "float16")[0]
    assert not oracle.close(["float32", [1], [0.414]], want[:3], "float16")[0]
    assert not oracle.close(["float32", [1], [0.459 + 5.0], 139.0], want, "float16")[0]


def _rank(rank, status="done", message=None, types=("builtins.RuntimeError",), step=2, t=0.1,
          rc=None, stderr="", outs=None):
    from fuzz.runner import RankResult

    error = message and {"step": step, "t": t, "types": list(types), "message": message}
    steps = {s: {"step": s, "t": 0.2, "first": s == 0, "outs": dict(outs or {})}
             for s in range(step if error else 4)}
    return RankResult(rank, (1 if error else 0) if rc is None else rc, status if not error
                      else "error", steps, error, stderr)


def _run(*ranks, timed_out=False):
    from fuzz.runner import RunResult

    return RunResult("fxcoalesce", len(ranks), 5.0, timed_out, list(ranks))


MISMATCH = "fxcoalesce: rank 0 runs step_fn uncompiled here; Config(passes=('schedule',))"
CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
          "closed by peer [127.0.0.1]:44257. This is typically caused by a remote worker "
          "crashing. Check the logs of the remote worker before reporting an error.")
LOUD = ("fxcoalesce.errors.CollectiveMismatchError",)


def test_the_oracle_counts_loud_one_rank_that_says_why_and_peers_the_transport_ended():
    """Issue 49's promise: the rank that sees the mismatch raises CollectiveMismatchError;
    each other rank fails no later and no less clearly than under plain when a peer raises:
    its own loud error, or gloo's "Connection closed by peer" as that rank's process ends
    (within the step's allowance); never a group timeout, an abort, or a finish."""
    plain = _run(_rank(0), _rank(1), _rank(2))
    judge = oracle.judge
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=MISMATCH,
                                                                      types=LOUD),
                      _rank(2, message=MISMATCH, types=LOUD)), plain, "float32").outcome == "loud"
    v = judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=CLOSED),
                   _rank(2, message="Connection reset by peer", step=3)), plain, "float32")
    assert v.outcome == "loud" and "transport's error on ranks [1, 2]" in v.detail, v
    # the store's end as rank 0 (its host) leaves; an error naming fxcoalesce and a fix
    store = "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote " \
            "server shutdown or crash?"
    assert judge(_run(_rank(0, message=MISMATCH), _rank(1, message=store),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "loud"
    # a group timeout on a peer: a hang, loud or not elsewhere
    timeout = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv"
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=timeout),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "hang"
    # gloo's size-mismatch abort on a peer: killed, whatever the others said
    size = ("Received data size doesn't match expected size. Is there a distributed "
            "collective mismatch in your code?")
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=size,
                                                                      stderr=size),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "killed"
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=CLOSED, rc=-6),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "killed"
    # a peer that finished normally, or whose error says nothing clear: partial
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "partial_error"
    unclear = "BackendCompilerFailed: backend='fxcoalesce' raised: AssertionError"
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=unclear),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "partial_error"
    # the transport's error on every rank, none loud: an error; on one rank only: partial
    assert judge(_run(_rank(0, message=CLOSED), _rank(1, message=CLOSED),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "error"
    assert judge(_run(_rank(0, message=CLOSED), _rank(1), _rank(2)), plain,
                 "float32").outcome == "partial_error"
    # the transport's error later than plain's allowance at that step: slow, not loud
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=CLOSED, t=25.0),
                      _rank(2, message=CLOSED)), plain, "float32").outcome == "slow"
    # a rank beyond a smaller group (stopped) takes no part
    assert judge(_run(_rank(0, message=MISMATCH, types=LOUD), _rank(1, message=CLOSED),
                      _rank(2, status="stopped")), plain, "float32").outcome == "loud"


def test_the_oracle_compares_a_caught_exception_like_an_output():
    """``rec.raised``: an exception the program caught and expected is an output: a variant
    that raises it where plain did, ok; one that does not (or raises another), wrong."""
    raised = {"bad": ["raised ValueError", [], []]}
    plain = _run(_rank(0, outs=raised), _rank(1, outs=raised))
    assert oracle.judge(_run(_rank(0, outs=raised), _rank(1, outs=raised)), plain,
                        "float32").outcome == "ok"
    v = oracle.judge(_run(_rank(0, outs=raised), _rank(1)), plain, "float32")
    assert v.outcome == "wrong" and "outputs [] vs ['bad']" in v.detail, v
    other = {"bad": ["raised RuntimeError", [], []]}
    v = oracle.judge(_run(_rank(0, outs=raised), _rank(1, outs=other)), plain, "float32")
    assert v.outcome == "wrong" and "raised RuntimeError" in v.detail, v


def test_the_harness_runs_streams_and_raises_the_error_raised_first():
    """``H.threads`` (the ``threads`` class): each call on its own thread, results in order;
    where streams fail, the error raised first (the cause: a stream's stop ends the other's
    collectives after it)."""
    import time

    from fuzz import harness

    assert harness.threads(lambda a, b: a * b, [(2, 3), (4, 5)]) == [6, 20]

    def stream(t):
        if t == 1:
            raise ValueError("the cause")
        time.sleep(0.5)  # a collective that fails as the peer leaves
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(ValueError, match="the cause"):
        harness.threads(stream, [(0,), (1,)])
