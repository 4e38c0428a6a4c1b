"""Where the token split would split full-size models, and what it predicts (issue 50 item 5).

No GPU: each model's step is traced once per token count at full size under fake tensors
(``apps.trace.trace_model``, the passes off), then the pipeline runs on that graph once per
cost model, with the split chosen by cost (``Config.token_split=None``) and forced (``True``,
for its price where cost declines). Per row: the stretches the split would take, its
predicted saving a step (the pass's own price: communication hidden minus the weights read
twice and the launches), and the exposed communication before -> after.

    python benchmarks/split_table.py --out benchmarks/results/split_table_fullsize_2026-12-07

Cost models: the two measured profiles (2 x H200 over NVLink, and with P2P off: through host
memory, PCIe-like; ``fxcoalesce calibrate --tp 2``), so those rows are at TP 2; at TP 8 no
profile was measured here (several GPUs are not lent), so the TP 8 rows price communication
with the ring model (NCCL's tuner constants over PCIe 4.0, 20 GB/s: 92 µs for a 42 KB
all_reduce at 8 ranks, where the story's PCIe box measured ~200) and compute with the H200's
measured roofline and the P2P-off overlap efficiency: a model's guess, to say what to measure
first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILES = {"nvlink": "gpu_h200x2_2026-11-30/calibrate_nvlink_overlap.json",
            "p2p-off": "gpu_h200x2_2026-11-30/calibrate_p2poff_overlap.json"}
TOKENS = (16, 128, 512, 1024)
MODELS = (("llama-3-8b", "forward"), ("kimi-k2", "verify"))


def costs(tp: int) -> dict:
    from fxcoalesce.config import CostModel

    if tp == 2:
        return {k: CostModel.from_profile(ROOT / "benchmarks/results" / v)
                for k, v in PROFILES.items()}
    h200 = CostModel.from_profile(ROOT / "benchmarks/results" / PROFILES["p2p-off"])
    return {"ring over PCIe (model)": CostModel(
        peak_tflops=h200.peak_tflops, memory_gbps=h200.memory_gbps, kernel_us=h200.kernel_us,
        overlap_efficiency=h200.overlap_efficiency)}


def row(before, cfg, tokens: int) -> dict:
    """The pipeline on ``before`` with ``cfg``, by cost and forced: the split's decisions."""
    from fxcoalesce.pipeline import run_pipeline
    from fxcoalesce.report import split_taken

    out = {}
    for how, split in (("by cost", None), ("forced", True)):
        t0 = time.perf_counter()
        _, report = run_pipeline(before, replace(cfg, token_split=split), record=False,
                                 emit=False)
        mine = [d for d in report.decisions if d.get("pass") == "split"]
        taken = split_taken(mine)
        pred = report.predicted_comm_us
        out[how] = {
            "stretches": len(mine), "split": len(taken),
            "saving_ms": round(sum(d.get("predicted_us", {}).get("saving", 0.0)
                                   for d in taken) / 1e3, 3),
            "exposed_ms": [round(pred["before"]["exposed"] / 1e3, 3),
                           round(pred["after"]["exposed"] / 1e3, 3)],
            "why_not": next((d["note"] for d in mine if d["chose"] == "whole"), None),
            "pass_s": round(time.perf_counter() - t0, 1)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--tp", type=int, nargs="*", default=[2, 8])
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a quick look)")
    args = p.parse_args(argv)
    from fxcoalesce.apps.trace import trace_model
    from fxcoalesce.config import Config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, step in MODELS:
        for tp in args.tp:
            for n in args.tokens:
                t0 = time.perf_counter()
                t = trace_model(name, tp=tp, tokens=n, step=step, layers=args.layers,
                                config=Config(passes=()))
                traced = time.perf_counter() - t0
                for cost_name, cost in costs(tp).items():
                    r = {"model": name, "step": step, "tp": tp, "tokens": n,
                         "cost": cost_name, "trace_s": round(traced, 1),
                         **row(t.before, Config(cost=cost), n)}
                    rows.append(r)
                    c, f = r["by cost"], r["forced"]
                    print(f"{name:10s} {step:7s} TP {tp} {n:5d} tokens  {cost_name:20s} "
                          f"by cost: {c['split']}/{c['stretches']} split, "
                          f"{-c['saving_ms']:+.3f} ms; forced {-f['saving_ms']:+.3f} ms, "
                          f"exposed {f['exposed_ms'][0]:.3f} -> {f['exposed_ms'][1]:.3f} ms "
                          f"(pass {f['pass_s']} s)", flush=True)
                (out / "table.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(markdown(rows))
    print(f"wrote {out / 'table.md'}")
    return 0


def markdown(rows: list[dict]) -> str:
    lines = ["| model | TP | tokens | cost model | split by cost | predicted a step | "
             "forced: predicted | exposed comm, forced (ms) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, f = r["by cost"], r["forced"]
        lines.append(
            f"| {r['model']} {r['step']} | {r['tp']} | {r['tokens']} | {r['cost']} | "
            f"{c['split']} of {c['stretches']} | {-c['saving_ms']:+.3f} ms | "
            f"{-f['saving_ms']:+.3f} ms | {f['exposed_ms'][0]:.3f} -> {f['exposed_ms'][1]:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
