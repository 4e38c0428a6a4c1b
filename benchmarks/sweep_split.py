"""The token split (issue 50) measured: llama-tiny's forward at hidden 1024 from decode to
prefill sizes, plain Inductor, fxcoalesce without the split, with it (forced on) and the
no-comm floor, every variant in the same rounds (one ``fxcoalesce bench`` run); beside it
the cost model's prediction (the split's predicted saving and what it chooses by cost,
traced under fake tensors with the default cost model, as the bench compiles).

    python benchmarks/sweep_split.py --out benchmarks/results/split_<date>
    python benchmarks/sweep_split.py --summarize-only --out <dir>

Over the emulated link, create the namespaces first (root) and pass them on:
``FXCOALESCE_RANK_NETNS=...@addr GLOO_SOCKET_IFNAME=tp0 python benchmarks/sweep_split.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sweep_sizes import faster, paired  # noqa: E402

VARIANTS = "inductor,fxcoalesce-no-split,fxcoalesce-split,no-comm"


def predictions(tokens: list[int], dim: int, layers: int, link_gbps: float | None,
                profile: str | None = None) -> dict[int, dict]:
    """Per token count: the split's predicted saving (ms a step, forced on) and the choice
    the cost model makes, from the pass's report on a fake-traced step: the default model
    (what the bench compiled with: a 20 GB/s PCIe ring) and, as "link", ``profile`` (a
    ``fxcoalesce calibrate`` of the link) or else a ring at ``link_gbps``, the emulated
    link's rate."""
    import torch

    from fxcoalesce.apps.launch import init_fake_group
    from fxcoalesce.apps.trace import trace_step
    from fxcoalesce.config import Config, CostModel
    from fxcoalesce.models import apply_tp, build
    from torch._subclasses.fake_tensor import FakeTensorMode

    out = {}
    group = init_fake_group(2)
    for n in tokens:
        row = {}
        configs = [("forced", Config(token_split=True)), ("by_cost", Config())]
        if profile or link_gbps:
            link = (CostModel.from_profile(profile) if profile else
                    CostModel(bandwidth_gbps=link_gbps))
            configs += [("forced_link", Config(token_split=True, cost=link)),
                        ("by_cost_link", Config(cost=link))]
        for key, cfg in configs:
            mode = FakeTensorMode()
            with mode:
                model = apply_tp(build("llama-tiny", dim=dim, layers=layers), group)
                args = (torch.randint(0, 512, (1, n)),)
            _, _, report = trace_step(model, args, mode, config=cfg)
            split = [d for d in report.decisions if d["pass"] == "split"]
            row[key] = {"notes": [d["note"] for d in split],
                        "saving_ms": sum(d.get("predicted_us", {}).get("saving", 0.0)
                                         for d in split) / 1e3,
                        "chose": [d["chose"] for d in split]}
        out[n] = row
    torch.distributed.destroy_process_group()
    return out


def summarize(bench: dict, pred: dict) -> tuple[list[dict], str]:
    rows, lines = [], ["| tokens | inductor ms | no-split ms | split ms | no-comm ms | split "
                       "vs inductor | split vs no-split: rounds split faster, median gain ms | "
                       "exposed comm inductor -> split ms | predicted saving ms (default; "
                       "link) | by cost (default; link) |", "|" + "---|" * 10]
    overlap_lines: list[str] = []
    for rec in bench if isinstance(bench, list) else [bench]:
        v = rec["variants"]
        n = rec["tokens"]
        med = {k: v[k]["median_ms"] for k in v}
        split, plain, nos = v.get("fxcoalesce-split"), v.get("inductor"), v.get(
            "fxcoalesce-no-split")
        floor = med.get("no-comm")
        pair = paired(nos, split) if split and nos else None
        p = pred.get(str(n), pred.get(n, {}))
        row = {"tokens": n, **{f"{k}_ms": m for k, m in med.items()},
               "split_vs_inductor": med["inductor"] / med["fxcoalesce-split"],
               "split_beats_inductor": faster(split, plain),
               "inductor_beats_split": faster(plain, split),
               "split_beats_no_split": faster(split, nos),
               # paired(a, b): median of b - a, rounds where a was faster, rounds
               "split_faster_rounds_vs_no_split": (f"{pair[2] - pair[1]}/{pair[2]}"
                                                   if pair else None),
               "measured_gain_vs_no_split_ms": -pair[0] if pair else None,
               "predicted_saving_ms": p.get("forced", {}).get("saving_ms"),
               "predicted_saving_link_ms": p.get("forced_link", {}).get("saving_ms"),
               "by_cost": p.get("by_cost", {}).get("chose"),
               "by_cost_link": p.get("by_cost_link", {}).get("chose")}
        if (ov := v.get("inductor-overlap")) is not None:  # Inductor 2.15's own best
            row |= {"split_vs_overlap": med["inductor-overlap"] / med["fxcoalesce-split"],
                    "split_beats_overlap": faster(split, ov),
                    "overlap_beats_split": faster(ov, split)}
            against = ("faster" if row["split_beats_overlap"] else "slower"
                       if row["overlap_beats_split"] else "tie")
            overlap_lines.append(f"| {n} | {med['inductor-overlap']:.2f} | "
                                 f"{med['fxcoalesce-split']:.2f} | "
                                 f"{row['split_vs_overlap']:.2f}x ({against}) |")
        rows.append(row)
        exposed = (f"{med['inductor'] - floor:.1f} -> {med['fxcoalesce-split'] - floor:.1f}"
                   if floor is not None else "-")
        verdict = ("faster" if row["split_beats_inductor"] else "slower"
                   if row["inductor_beats_split"] else "tie")
        lines.append(
            f"| {n} | {med['inductor']:.2f} | {med['fxcoalesce-no-split']:.2f} | "
            f"{med['fxcoalesce-split']:.2f} | {floor if floor is None else f'{floor:.2f}'} | "
            f"{row['split_vs_inductor']:.2f}x ({verdict}) | "
            f"{row['split_faster_rounds_vs_no_split']}, {row['measured_gain_vs_no_split_ms']:+.1f}"
            f" | {exposed} | {_ms(row['predicted_saving_ms'])}; "
            f"{_ms(row['predicted_saving_link_ms'])} | {','.join(row['by_cost'] or ['-'])}; "
            f"{','.join(row['by_cost_link'] or ['-'])} |")
    if overlap_lines:
        lines += ["", "| tokens | inductor-overlap ms | split ms | split vs inductor-overlap |",
                  "|---|---|---|---|", *overlap_lines]
    return rows, "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:+.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,16,128,512,1024")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--variants", default=VARIANTS, help="bench's variants (add "
                    "inductor-overlap under torch >= 2.15: its overlap scheduler, bucketing)")
    ap.add_argument("--summarize-only", action="store_true")
    ap.add_argument("--predict", action="store_true", help="predict again (with --summarize-only)")
    ap.add_argument("--link-gbps", type=float, default=0.125,
                    help="the link's rate for the second prediction (GB/s; 0.125 = 1 Gbit/s)")
    ap.add_argument("--profile", help="the second prediction from this profile of the link "
                                      "(fxcoalesce calibrate over it) instead of a ring")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    where = out / f"llama-tiny_forward_d{args.dim}"
    tokens = [int(t) for t in args.tokens.split(",")]
    if not args.summarize_only:
        cli = Path(sys.executable).parent / "fxcoalesce"
        cmd = [str(cli), "bench", "--model", "llama-tiny", "--step", "forward", "--dim",
               str(args.dim), "--layers", str(args.layers), "--tokens", args.tokens,
               "--variants", args.variants, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--out", str(where)]
        print("$ fxcoalesce", " ".join(cmd[1:]), file=sys.stderr, flush=True)
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, timeout=args.timeout)
        print(f"  bench: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if not args.summarize_only or args.predict:
        (out / "predictions.json").write_text(json.dumps(
            predictions(tokens, args.dim, args.layers, args.link_gbps, args.profile),
            indent=2))
    bench = json.loads((where / "bench.json").read_text())
    pred = json.loads((out / "predictions.json").read_text())
    rows, table = summarize(bench, pred)
    (out / "table.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
    print(table)
    if rows:
        ratio = statistics.median(r["fxcoalesce-split_ms"] / r["fxcoalesce-no-split_ms"]
                                  for r in rows)
        print(f"median split / no-split: {ratio:.3f}")


if __name__ == "__main__":
    main()
