"""Run one fuzz program under one variant: one OS process per rank (gloo on CPU, loopback),
each writing its results file (``harness``); here we collect those, the exit codes and the
stderr tails. Needs only torch and the stdlib, like the programs themselves.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import zygote

ROOT = Path(__file__).resolve().parents[2]
# set per run and per rank (pytest's per test); read by nothing zygote.PRELOAD imports
_PER_RUN = ("MASTER_PORT", "FUZZ_PORTS", "WORLD_SIZE", "FUZZ_VARIANT", "FUZZ_INDUCTOR",
            "FUZZ_GROUP_TIMEOUT", "TORCHINDUCTOR_CACHE_DIR", "RANK", "FUZZ_RESULTS",
            "PYTEST_CURRENT_TEST")


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: still running at the wall limit, killed by the runner
    status: str  # done | stopped | error | none (the process left no final line)
    steps: dict = field(default_factory=dict)  # step -> {"t", "first", "outs"}
    error: dict | None = None  # {"step", "t", "types", "message"}
    stderr: str = ""  # the tail

    def summary(self) -> dict:
        err = self.error and {k: self.error[k] for k in ("step", "types", "message")}
        notes = [x for x in self.stderr.splitlines() if x.startswith("fxcoalesce")
                 or "what():" in x]
        return {"rank": self.rank, "returncode": self.returncode, "status": self.status,
                "steps": len(self.steps), "error": err, "notes": notes[:20],
                "stderr_tail": self.stderr[-3000:]}


@dataclass
class RunResult:
    variant: str
    world: int
    wall_s: float
    timed_out: bool  # the runner killed ranks at the wall limit
    ranks: list[RankResult]

    def finished(self) -> bool:
        return not self.timed_out and all(r.status in ("done", "stopped") and r.returncode == 0
                                          for r in self.ranks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(rank: int, results: Path, returncode, stderr: Path) -> RankResult:
    res = RankResult(rank, returncode, "none")
    if results.exists():
        for line in results.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            kind = event.pop("event")
            if kind == "step":
                res.steps[event["step"]] = event
            elif kind == "error":
                res.status, res.error = "error", event
            elif kind in ("done", "stopped"):
                res.status = kind
    if stderr.exists():
        res.stderr = stderr.read_text(errors="replace")[-8000:]
    return res


def run(text: str, variant: str, world: int, *, inductor: bool, group_timeout: float = 40,
        wall_s: float = 300, workdir: str | None = None, env: dict | None = None) -> RunResult:
    """Run program ``text`` on ``world`` gloo ranks under ``variant`` (harness.VARIANTS);
    ranks still running after ``wall_s`` are killed. A port taken in between is retried."""
    for attempt in range(3):
        res = _run_once(text, variant, world, inductor, group_timeout, wall_s, workdir, env)
        if not any("Address already in use" in r.stderr for r in res.ranks):
            return res
    return res


def _run_once(text, variant, world, inductor, group_timeout, wall_s, workdir, env) -> RunResult:
    own = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="fxfuzz-")) / variant
    work.mkdir(parents=True, exist_ok=True)
    script = work / "program.py"
    script.write_text(text)
    ports = [free_port() for _ in range(4)]
    base = {**os.environ, **(env or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                        os.environ.get("PYTHONPATH")])),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0]),
            "FUZZ_PORTS": ",".join(map(str, ports[1:])), "WORLD_SIZE": str(world),
            "FUZZ_VARIANT": variant, "FUZZ_INDUCTOR": "1" if inductor else "0",
            "FUZZ_GROUP_TIMEOUT": str(group_timeout), "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
            # CPU programs: on a GPU machine, no CUDA (a zygote's fork could not start it)
            "CUDA_VISIBLE_DEVICES": "",
            # a fresh compile cache per run: a replay starts from where the run started
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")}
    shared = {k: v for k, v in base.items() if k not in _PER_RUN}  # what the imports see
    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        for name in ("results.jsonl", "stderr.txt", "stdout.txt"):
            (work / f"rank{rank}.{name}").unlink(missing_ok=True)
        env_r = {**base, "RANK": str(rank),
                 "FUZZ_RESULTS": str(work / f"rank{rank}.results.jsonl")}
        out, err = work / f"rank{rank}.stdout.txt", work / f"rank{rank}.stderr.txt"
        if zygote.usable():
            procs.append(zygote.fork(rank, str(script), str(work), env_r, str(out), str(err),
                                     shared))
            continue
        with open(out, "w") as out_f, open(err, "w") as err_f:
            procs.append(subprocess.Popen([sys.executable, str(script)], cwd=work,
                                          stdout=out_f, stderr=err_f, env=env_r,
                                          start_new_session=True))
    timed_out = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() - t0 > wall_s:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            for p in procs:
                p.wait()
            break
        time.sleep(0.1)
    wall = time.monotonic() - t0
    ranks = [_read(r, work / f"rank{r}.results.jsonl", None if timed_out and p.returncode ==
                   -signal.SIGKILL else p.returncode, work / f"rank{r}.stderr.txt")
             for r, p in enumerate(procs)]
    if own:
        import shutil

        shutil.rmtree(work.parent, ignore_errors=True)
    return RunResult(variant, world, wall, timed_out, ranks)
