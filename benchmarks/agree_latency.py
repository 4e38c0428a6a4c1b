"""What the ranks' agreement adds to each compiled graph of an SPMD program (issue 20).

Two parts, both measured inside the compile (``report.agreement``):

- ``ladder_ms``: the FX pipeline run at the ladder's other steps (the first step's run is what
  any compile with the passes pays);
- ``exchange_ms``: publishing the proposal, waiting for the peers' and writing/reading the
  decision through the default group's store (TCPStore on loopback here).

``--ranks``: real gloo ranks (2), each compiling a zoo model's step with the backend
(Inductor), ranks started together: the SPMD case. ``--trace``: a full-size graph traced on the
fake group (no peers, no exchange), the pipeline timed at every ladder step: what the ladder
costs where graphs are large.

    python benchmarks/agree_latency.py --out benchmarks/results/agree_latency.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

RANK_CASES = (("neox-tiny", "forward"), ("llama-tiny", "forward"), ("kimi-k2-tiny", "verify"))
TRACE_CASES = (("kimi-k2", "verify", 8), ("falcon-40b", "forward", 8))


def _rank(rank, world, name, step):
    import fxcoalesce
    from fxcoalesce import models
    from fxcoalesce.apps.steps import make_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = models.build(name, dtype=torch.float32)
    models.apply_tp(model, torch.distributed.group.WORLD)
    fn, args = make_step(model, step, 8)
    fxcoalesce.clear_reports()
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.compile(fn, backend="fxcoalesce", fullgraph=True)(*args)
    first_call_s = time.perf_counter() - t0
    [report] = fxcoalesce.reports()
    a = report.agreement  # {} where nothing was compared (no pass could change the sequence)
    return {"first_call_s": round(first_call_s, 3), "pipeline_ms": report.total_ms,
            "ladder_ms": a.get("ladder_ms"), "exchange_ms": a.get("exchange_ms"),
            "waited_s": a.get("waited_s"), "how": a.get("how"), "step": a.get("step"),
            "after": report.all_reduce["after"], "before": report.all_reduce["before"]}


def ranks(repeat: int) -> list[dict]:
    from fxcoalesce.apps.launch import spawn

    rows = []
    for name, step in RANK_CASES:
        runs = []
        for _ in range(repeat):  # cold compiles: a fresh Inductor cache for every run
            with tempfile.TemporaryDirectory() as cache:
                runs.append(spawn(_rank, 2, (name, step), backend="gloo", timeout=900,
                                  env={"TORCHINDUCTOR_CACHE_DIR": cache}))
        per_rank = [r for run in runs for r in run]
        med = {k: statistics.median(r[k] or 0.0 for r in per_rank)
               for k in ("first_call_s", "pipeline_ms", "ladder_ms", "exchange_ms")}
        rows.append({"model": name, "step": step, "ranks": 2, "repeat": repeat,
                     "median": med, "runs": runs})
        print(f"{name} {step}: first call {med['first_call_s']:.2f} s, pipeline "
              f"{med['pipeline_ms']:.1f} ms, ladder +{med['ladder_ms']:.1f} ms, exchange "
              f"+{med['exchange_ms']:.1f} ms ({runs[0][0]['how']}, "
              f"{runs[0][0]['before']} -> {runs[0][0]['after']})", flush=True)
    return rows


def trace(repeat: int) -> list[dict]:
    import fxcoalesce
    from fxcoalesce.apps.trace import trace_model
    from fxcoalesce.collectives import program_sequence
    from fxcoalesce.ranks.compile import ladder_runs

    rows = []
    for name, step, tp in TRACE_CASES:
        t = trace_model(name, tp=tp, tokens=16, step=step)
        cfg = fxcoalesce.Config(codegen="eager")
        program = program_sequence(t.before.graph)
        first, ladder_ms = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fxcoalesce.run_pipeline(t.before, cfg, record=False)
            t1 = time.perf_counter()
            ladder_runs(t.before, cfg, "bench", program)  # what rewrite_agreed runs
            t2 = time.perf_counter()
            first.append((t1 - t0) * 1e3)
            ladder_ms.append((t2 - t1) * 1e3 - (t1 - t0) * 1e3)
        rows.append({"model": name, "step": step, "tp": tp, "nodes": len(t.before.graph.nodes),
                     "trace_s": round(t.seconds, 1),
                     "pipeline_ms": round(statistics.median(first), 1),
                     "ladder_ms": round(statistics.median(ladder_ms), 1)})
        r = rows[-1]
        print(f"{name} {step} TP {tp} ({r['nodes']} nodes): pipeline {r['pipeline_ms']:.0f} ms, "
              f"the ladder's other steps +{r['ladder_ms']:.0f} ms (trace {t.seconds:.0f} s)",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("ranks", "trace"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = {"date": str(date.today()), "torch": torch.__version__,
           "command": "python benchmarks/agree_latency.py " + " ".join(
               f"--{k} {v}" for k, v in (("repeat", args.repeat), ("only", args.only))
               if v is not None)}
    if args.only != "trace":
        out["ranks"] = ranks(args.repeat)
    if args.only != "ranks":
        out["trace"] = trace(args.repeat)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
