"""Tier 3, rank safety: generated programs on real gloo ranks, fxcoalesce against plain
``torch.compile`` (tests/fuzz: the generator, the runner, the oracle, record and replay).

Default run: two of the nine fixed seeds on 2 ranks (DEFAULT: a flag one rank sets and a
print inside a layer loop; a collective disabled on one rank) and the generator's own
checks (no ranks); 15-30 s a seed while fxcoalesce passes them (a hang costs the 30 s group
timeout more). The recorded failures under tests/data/fuzz/ replay in CI's part 4 (each
one's first variant, against plain; RECENT ones in the default run too) and, every variant,
in the slow run.
Slow run (``-m slow``): the other seven fixed seeds (together the nine draw every feature of
the grammar; about 3.5 minutes in all on 2 shared cores) and FXCOALESCE_FUZZ_N fresh programs
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
# long runs and Inductor (the slow run draws those)
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
}


DEFAULT = {10002, 221}
"""The fixed seeds of the default run (issue 32's kinds: a flag one rank sets, a print in a
loop Dynamo skips on one rank, a collective disabled on one rank); the others are slow."""

KNOWN: dict[int, str] = {}
"""Fixed programs that fail today for a reason understood and written down: strict xfails,
so a fix flips them (then move them back to FIXED)."""


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
    # loud error on every rank; never a wrong value, a killed rank, a hang, a longer wait
    assert not _failures(res), (f"seed {seed} ({FIXED[seed]}): {_failures(res)}; "
                                f"recorded in {res.get('record')}")


def _slow_only(path) -> bool:
    """A record marked ``slow_only`` (its class replays in the default run through another)."""
    return bool(json.loads(path.read_text()).get("slow_only"))


RECENT: set[str] = set()
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
         "compile.two_fns"}
    assert grammar <= set(drawn), grammar - set(drawn)
    fixed = set().union(*(generate(s, 2, inductor=False).features for s in FIXED))
    assert grammar - fixed == {"steps.many", "steps.long", "compile.inductor"}, grammar - fixed


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
