"""The pipeline's own time on one traced graph, run again and again: medians per pass.

    python benchmarks/pipeline_time.py [--model falcon-40b] [--tp 8] [--tokens 3] [--layers N]
                                       [--repeat 5] [--profile out.prof] [--save DIR]

Traces the model once under fake tensors (as ``fxcoalesce inspect`` does; a minute for
full-size falcon-40b), then runs ``run_pipeline`` on the traced graph ``--repeat`` times with
the default Config and prints the median and the spread of ``Report.total_ms`` (what inspect
calls "pipeline time"), the process's CPU time around each run (less swayed by other jobs on a
shared machine) and each pass's median, with the load average before and after.
``--profile``: one more run under cProfile, its stats written there (``python -m pstats``).
``--save``: the rewritten graph's code and the report (times dropped) of the last run, to
diff against another commit's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pathlib
import statistics
import time

from fxcoalesce.apps.trace import trace_model
from fxcoalesce.config import Config
from fxcoalesce.pipeline import graph_text, run_pipeline

TIME_KEYS = ("total_ms", "analysis_ms", "ms")


def _untimed(obj):
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if k not in TIME_KEYS}
    if isinstance(obj, list):
        return [_untimed(v) for v in obj]
    return obj


def loadavg() -> str:
    return pathlib.Path("/proc/loadavg").read_text().split()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="falcon-40b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profile", type=pathlib.Path)
    p.add_argument("--save", type=pathlib.Path)
    p.add_argument("--warm", action="store_true", help="keep the input graph's compute "
                   "estimates between runs (by default each run makes them, as inspect's does)")
    args = p.parse_args()
    traced = trace_model(args.model, tp=args.tp, tokens=args.tokens, layers=args.layers)
    gm, cfg = traced.before, Config(codegen="eager")
    print(f"{args.model} TP {args.tp}: {len(gm.graph.nodes)} nodes, traced in "
          f"{traced.seconds:.1f} s (its pipeline {traced.report.total_ms:.0f} ms)", flush=True)
    from fxcoalesce import cost
    from fxcoalesce.passes import PASSES

    pass_cpu: dict[str, list[float]] = {}

    def timed(name, fn):
        def run(*a, **k):
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                pass_cpu.setdefault(name, []).append((time.process_time() - t) * 1e3)
        return run

    for name, fn in list(PASSES.items()):
        PASSES[name] = timed(name, fn)
    load0, totals, passes, cpu = loadavg(), [], {}, []
    for _ in range(args.repeat):
        if not args.warm:  # as inspect's one run: no compute estimate of the input kept
            cost._ESTIMATES.clear()
        t = time.process_time()
        after, report = run_pipeline(gm, cfg, name="graph", record=False, emit=False)
        cpu.append((time.process_time() - t) * 1e3)
        totals.append(report.total_ms)
        passes.setdefault("analysis", []).append(report.analysis_ms)
        for q in report.passes:
            passes.setdefault(q["name"], []).append(q["ms"])
    load1 = loadavg()
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"pipeline {med(totals):.1f} ms median of {len(totals)} "
          f"(min {min(totals):.1f}, max {max(totals):.1f}); this process's CPU time "
          f"{med(cpu):.1f} ms median (min {min(cpu):.1f}); load {load0} -> {load1}")
    print("  wall: " + ", ".join(f"{k} {med(v):.1f}" for k, v in passes.items()))
    print("  CPU:  " + ", ".join(f"{k} {med(v):.1f}" for k, v in pass_cpu.items()))
    print(f"  all_reduce {report.all_reduce['before']} -> {report.all_reduce['after']}, "
          f"bytes {report.all_reduce.get('bytes_before')} -> "
          f"{report.all_reduce.get('bytes_after')}")
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        (args.save / "after.txt").write_text(graph_text(after, report.modules))
        (args.save / "report.json").write_text(
            json.dumps(_untimed(json.loads(report.to_json())), indent=1, sort_keys=True))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_pipeline(gm, cfg, record=False, emit=False)
        prof.disable()
        prof.dump_stats(args.profile)
        print(f"wrote {args.profile}")


if __name__ == "__main__":
    main()
