"""How long tracing and rewriting a full-width model takes under fake tensors, by depth.

    python benchmarks/trace_time.py [--model falcon-40b] [--layers 15 30 60 120 240] [--tp 8]
                                    [--step forward|verify] [--out results/....json]

One line per layer count, and a JSON list: the wall time of build + trace + pipeline
(``Traced.seconds``), the whole pipeline's milliseconds (``Report.total_ms``: analyses, graph
copy, passes, lint, report) with the per-pass share, and the all_reduce counts. The pipeline
should grow about linearly with the layer count. Timings live here rather than in the tests: on a shared machine the wall clock is a
measurement, not a pass/fail criterion.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from fxcoalesce.apps.trace import trace_model

RESULTS = pathlib.Path(__file__).parent / "results"


def time_depths(model: str, layer_counts: list[int], tp: int, tokens: int,
                step: str = "forward") -> list[dict]:
    rows = []
    for layers in layer_counts:
        traced = trace_model(model, tp=tp, tokens=tokens, layers=layers, step=step)
        r = traced.report
        rows.append(dict(model=model, step=step, layers=layers, tp=tp, tokens=tokens,
                         nodes=r.nodes["before"], trace_s=round(traced.seconds, 3),
                         pipeline_ms=r.total_ms, analysis_ms=r.analysis_ms,
                         passes_ms={p["name"]: p["ms"] for p in r.passes},
                         all_reduce=r.all_reduce))
        print(f"{model} {step} layers={layers:4d} TP={tp}: {r.nodes['before']} nodes, "
              f"build+trace+pipeline {traced.seconds:6.1f} s, pipeline {r.total_ms:8.1f} ms, "
              f"all_reduce {r.all_reduce['before']} -> {r.all_reduce['after']} "
              f"(bound {r.all_reduce['lower_bound']})", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="falcon-40b")
    p.add_argument("--layers", type=int, nargs="+", default=[15, 30, 60, 120, 240])
    p.add_argument("--step", default="forward", choices=["forward", "verify"])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--out", type=pathlib.Path, help="JSON path (default: results/"
                   "trace_time_<model>_tp<tp>.json next to this script)")
    args = p.parse_args()
    rows = time_depths(args.model, args.layers, args.tp, args.tokens, args.step)
    first, last = rows[0], rows[-1]
    if last["layers"] != first["layers"]:
        growth = last["pipeline_ms"] / first["pipeline_ms"]
        print(f"pipeline time x{growth:.2f} for x{last['layers'] / first['layers']:.2f} layers")
    out = args.out or RESULTS / f"trace_time_{args.model}_{args.step}_tp{args.tp}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
