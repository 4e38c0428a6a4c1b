"""One program through every variant, judged, and its failures kept; replaying kept ones.

``fuzz_one(program)`` runs eager (optional), plain, then each fxcoalesce variant, and
returns a summary dict; each failure also goes to ``<failures>/<seed>.json`` (default
``property-failures/fuzz/``, gitignored): seed, world, variant, program text, each rank's
status and stderr tail. A fixed failure's file is copied by hand into ``tests/data/fuzz/``,
where ``tests/test_fuzz_ranks.py`` replays it (the recorded text, not a regenerated one).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from . import oracle, runner
from .gen import Program

VARIANTS = ("fxcoalesce", "check")
FAILURES_DIR = runner.ROOT / "property-failures" / "fuzz"
DATA_DIR = runner.ROOT / "tests" / "data" / "fuzz"


def fuzz_one(prog: Program, variants=VARIANTS, *, eager: bool = True,
             group_timeout: float = 40, wall_s: float | None = None,
             failures_dir: Path | None = FAILURES_DIR, keep: str | None = None,
             log=None) -> dict:
    """Run ``prog`` under eager (if asked), plain and ``variants``; judge; record failures.
    ``keep``: a directory to leave the runs' scripts and files in."""
    work = keep or tempfile.mkdtemp(prefix=f"fxfuzz-{prog.seed}-")
    wall_s = wall_s or 240 + 0.5 * prog.steps
    t0 = time.monotonic()
    out = {"seed": prog.seed, "world": prog.world, "features": list(prog.features),
           "inductor": prog.inductor, "steps": prog.steps, "variants": {}}

    def go(variant: str, limit: float) -> runner.RunResult:
        res = runner.run(prog.text, variant, prog.world, inductor=prog.inductor,
                         group_timeout=group_timeout, wall_s=limit, workdir=work)
        if log:
            log(f"seed {prog.seed} world {prog.world} {variant}: {res.wall_s:.1f} s, "
                + oracle._statuses(res))
        return res

    try:
        ref = go("eager", wall_s) if eager else None
        plain = go("plain", wall_s)
        out["plain_s"] = round(plain.wall_s, 1)
        skip = oracle.judge_plain(plain, ref, prog.dtype)
        if skip:
            out["plain"] = {"outcome": skip.outcome, "detail": skip.detail}
            return out
        out["plain"] = {"outcome": "ok"}
        failures = []
        for variant in variants:
            res = go(variant, min(wall_s, 3 * plain.wall_s + 2 * group_timeout + 60))
            verdict = oracle.judge(res, plain, prog.dtype)
            out["variants"][variant] = {"outcome": verdict.outcome, "detail": verdict.detail,
                                        "wall_s": round(res.wall_s, 1)}
            if verdict.failed:
                failures.append({"variant": variant, "outcome": verdict.outcome,
                                 "detail": verdict.detail,
                                 "ranks": [r.summary() for r in res.ranks],
                                 "plain_ranks": [r.summary() for r in plain.ranks]})
        if failures and failures_dir is not None:
            out["record"] = str(write(prog, failures, group_timeout, failures_dir))
        return out
    finally:
        out["wall_s"] = round(time.monotonic() - t0, 1)
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def write(prog: Program, failures: list, group_timeout: float, where: Path) -> Path:
    import torch

    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{prog.seed}.json"
    path.write_text(json.dumps({
        "seed": prog.seed, "world": prog.world, "inductor": prog.inductor,
        "steps": prog.steps, "features": list(prog.features), "torch": torch.__version__,
        "group_timeout": group_timeout, "variants": [f["variant"] for f in failures],
        "failures": failures, "text": prog.text}, indent=1))
    return path


def load(path: Path) -> tuple[Program, dict]:
    """A recorded failure: its program (the recorded text) and the record."""
    rec = json.loads(Path(path).read_text())
    prog = Program(rec["seed"], rec["world"], rec["text"], tuple(rec["features"]),
                   rec["inductor"], rec["steps"])
    return prog, rec


def replay_files(where: Path = DATA_DIR) -> list[Path]:
    return sorted(where.glob("*.json")) if where.is_dir() else []


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default
