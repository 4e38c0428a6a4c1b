"""Cold and warm compile time, plain torch.compile against the fxcoalesce backend.

Each compile runs in a fresh process (what a restarted server pays) on the fake process group
at TP 2, with one ``TORCHINDUCTOR_CACHE_DIR`` per (model, variant, repetition): cold = an
empty cache directory, warm = the same directory right after the cold compile. Timed: the
first call of the compiled step (Dynamo, AOTAutograd, the passes, Inductor, one run), and the
whole process. Variants alternate within each repetition; medians over ``--repeat``.

    python benchmarks/compile_time.py --out benchmarks/results/compile_time.json

The pass's own share is measured inside each compile too (``pass_ms``: the reports'
``pass_cost_ms``, the pipeline and any agreement; 0 for plain Inductor and for a cache hit,
which runs no pass). Also checks that a compile leaves nothing but Inductor's own cache layout behind (no
temporary directory per compile under the cache directory or the system's temp directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

CHILD = """
import sys, time, torch, fxcoalesce
from fxcoalesce import models
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.apps.steps import make_step
name, step, variant = sys.argv[1:4]
torch.manual_seed(0)
model = models.build(name, dtype=torch.float32)
models.apply_tp(model, init_fake_group(2))
fn, args = make_step(model, step, 8)
t0 = time.perf_counter()
with torch.no_grad():
    torch.compile(fn, backend=variant, fullgraph=True)(*args)
seconds = time.perf_counter() - t0
caches = [r.cache for r in fxcoalesce.reports()]
pass_ms = sum(r.pass_cost_ms()["total"] for r in fxcoalesce.reports() if not r.cache)
print("RESULT", seconds, ",".join(caches) or "-", pass_ms)
"""
CASES = (("neox-tiny", "forward"), ("kimi-k2-tiny", "verify"))
VARIANTS = ("inductor", "fxcoalesce")


def compile_once(name: str, step: str, variant: str, cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, name, step, variant], env=env,
                          capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{name} {variant}: {done.stderr[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    _, seconds, caches, pass_ms = line.split()
    return {"compile_s": float(seconds), "process_s": round(wall, 3), "reports": caches,
            "pass_ms": float(pass_ms)}


def temp_entries() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fxcoalesce-compile-time-"))
    before_tmp = temp_entries() | {root.name}
    rows, leftovers = [], []
    for name, step in CASES:
        runs = {v: {"cold": [], "warm": []} for v in VARIANTS}
        for rep in range(args.repeat):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                cache = root / f"{name}-{variant}-{rep}"
                for phase in ("cold", "warm"):
                    r = compile_once(name, step, variant, cache)
                    runs[variant][phase].append(r)
                    print(f"{name} {step} {variant} {phase} #{rep}: {r['compile_s']:.2f} s "
                          f"(process {r['process_s']:.2f} s, reports {r['reports']}, the "
                          f"pass {r['pass_ms']:.0f} ms)", file=sys.stderr)
                leftovers += [f"{cache.name}/{p.name}" for p in cache.iterdir()
                              if p.name.startswith("tmp")]
        med = {v: {ph: statistics.median(x["compile_s"] for x in runs[v][ph])
                   for ph in ("cold", "warm")} for v in VARIANTS}
        pass_ms = statistics.median(x["pass_ms"] for x in runs["fxcoalesce"]["cold"])
        rows.append({
            "model": name, "step": step, "tp": 2, "runs": runs, "median_compile_s": med,
            "cold_ratio": round(med["fxcoalesce"]["cold"] / med["inductor"]["cold"], 3),
            "warm_ratio": round(med["fxcoalesce"]["warm"] / med["inductor"]["warm"], 3),
            "median_pass_ms_cold": round(pass_ms, 1)})
        print(f"{name}: cold {med['inductor']['cold']:.2f} -> {med['fxcoalesce']['cold']:.2f} s "
              f"({rows[-1]['cold_ratio']}x; the pass {pass_ms:.0f} ms of it), warm "
              f"{med['inductor']['warm']:.2f} -> {med['fxcoalesce']['warm']:.2f} s "
              f"({rows[-1]['warm_ratio']}x)")
    new_tmp = sorted(temp_entries() - before_tmp)
    result = {"date": str(date.today()), "command": " ".join(["python", *sys.argv]),
              "machine": f"{os.cpu_count()} cores", "rows": rows,
              "temporary_dirs_left_in_cache_dirs": leftovers,
              "new_entries_in_system_temp": new_tmp}
    print(f"left behind: {leftovers or 'nothing'} in the cache directories; "
          f"{new_tmp or 'nothing'} new in {tempfile.gettempdir()}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
