"""How long tracing and rewriting a full-width model takes under fake tensors, by depth.

    python benchmarks/trace_time.py [--model falcon-40b] [--layers 8 16 60 120] [--tp 8]
                                    [--out benchmarks/results/trace_time_falcon-40b_tp8.json]

One line per layer count, and a JSON list: the wall time of build + trace + pipeline
(``Traced.seconds``), the analysis and per-pass milliseconds from the report, and the
all_reduce counts. The rewrite (analysis + passes) should grow about linearly with the layer
count. Timings live here rather than in the tests: on a shared machine the wall clock is a
measurement, not a pass/fail criterion.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from fxcoalesce.apps.trace import trace_model

RESULTS = pathlib.Path(__file__).parent / "results"


def time_depths(model: str, layer_counts: list[int], tp: int, tokens: int) -> list[dict]:
    rows = []
    for layers in layer_counts:
        traced = trace_model(model, tp=tp, tokens=tokens, layers=layers)
        r = traced.report
        rewrite_ms = r.analysis_ms + sum(p["ms"] for p in r.passes)
        rows.append(dict(model=model, layers=layers, tp=tp, tokens=tokens,
                         total_s=round(traced.seconds, 3), analysis_ms=r.analysis_ms,
                         passes_ms={p["name"]: p["ms"] for p in r.passes},
                         rewrite_ms=round(rewrite_ms, 3), all_reduce=r.all_reduce))
        print(f"{model} layers={layers:4d} TP={tp}: build+trace+rewrite {traced.seconds:6.1f} s, "
              f"analysis+passes {rewrite_ms:8.1f} ms, all_reduce {r.all_reduce['before']} -> "
              f"{r.all_reduce['after']} (bound {r.all_reduce['lower_bound']})", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="falcon-40b")
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 60, 120])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--out", type=pathlib.Path, help="JSON path (default: results/"
                   "trace_time_<model>_tp<tp>.json next to this script)")
    args = p.parse_args()
    rows = time_depths(args.model, args.layers, args.tp, args.tokens)
    first, last = rows[0], rows[-1]
    if last["layers"] != first["layers"]:
        growth = last["rewrite_ms"] / first["rewrite_ms"]
        print(f"rewrite time x{growth:.2f} for x{last['layers'] / first['layers']:.2f} layers")
    out = args.out or RESULTS / f"trace_time_{args.model}_tp{args.tp}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
