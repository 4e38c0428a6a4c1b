"""Where summing wins: plain Inductor, Inductor's overlap scheduler with collective bucketing
(torch 2.15), the hand-merged model and fxcoalesce, side by side, from decode to prefill sizes
(issue 34 item 4). One ``fxcoalesce bench`` run per (model, step, hidden size), every token
count in it, every variant timed in the same rounds (medians, p10-p90); then one table, one
plot, the crossover against the overlap scheduler and the cost model's prediction beside the
measured gain. "Faster beyond the noise" is judged round by round: each round runs every
variant once, so a round's two steps share its load; a variant is faster where a one-sided
sign test over the rounds gives p < 0.01 (13 of 15 rounds, 40 of 60:
``fxcoalesce.apps.bench.report.faster``, which ``fxcoalesce demo`` judges by too).

    python benchmarks/sweep_sizes.py --out benchmarks/results/sweep_gloo2_cpu_<date>
    python benchmarks/sweep_sizes.py --summarize-only --out <dir>   # table and plot again

Run it with torch 2.15 (the overlap scheduler's options are 2.15's; older torch skips that
variant). A bench run's own progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from fxcoalesce.apps.bench.report import faster, paired

VARIANTS = "inductor,inductor-overlap,hand-merged,fxcoalesce"
CASES = (  # (model, step, hidden, token counts, layers): parallel blocks, then MoE verify
    ("neox-tiny", "forward", 1024, "1,16,128,512,2048", 2),
    ("neox-tiny", "forward", 4096, "1,16,128", 2),
    ("kimi-k2-tiny", "verify", 1024, "3,16,64", 3),  # 1 dense layer, 2 MoE (3 for EAGLE-3)
)
"""Hidden 4096 stops at 128 tokens and the MoE at 64 on 2 CPU cores (a step of 2048 tokens at
hidden 4096 is seconds of matmuls: the sweep would take hours); a GPU run widens them."""


def run_case(model: str, step: str, dim: int, tokens: str, layers: int, args, out: Path
             ) -> Path:
    where = out / f"{model}_{step}_d{dim}"
    cli = Path(sys.executable).parent / "fxcoalesce"  # the installed command: "-m" from the
    cmd = [str(cli), "bench", "--model", model, "--step",  # checkout would miss its packages
           step, "--dim", str(dim), "--layers", str(layers), "--tokens", tokens,
           "--variants", args.variants, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--out", str(where)]
    print("$ fxcoalesce", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, timeout=args.timeout)
    print(f"  {model} {step} hidden {dim}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return where / "bench.json"


def measured_gain_ms(fx: dict, other: dict) -> float:
    """fxcoalesce's gain over ``other`` (ms): the median of the rounds' differences, where
    the steps were kept, else the difference of the medians."""
    pair = paired(fx, other)
    return pair[0] if pair else other["median_ms"] - fx["median_ms"]


def predicted_gain_ms(rec: dict) -> float | None:
    """What fxcoalesce's report predicts it saves a step against the program's own
    collectives (exposed communication before minus after), in ms."""
    pred = rec["variants"].get("fxcoalesce", {}).get("report_predicted_comm_us")
    if not pred:
        return None
    return sum(p["before"]["exposed"] - p["after"]["exposed"] for p in pred) / 1e3


def predicted_gain_vs_overlap_ms(rec: dict) -> float | None:
    """The same model's gain against the overlap scheduler: its buckets (launches and bytes
    as counted at run time, the bytes split evenly, none hidden: its generated code hides no
    kernel under them) priced by the bench's cost profile, minus fxcoalesce's predicted
    exposed time. None without a profile or either variant's counts, and where the overlap
    variant's counted bytes are not the program's (fxcoalesce's report: ``bytes_before``):
    the profiler's count on a warm Inductor cache, a multiple of the program's."""
    v = rec["variants"]
    fx = v.get("fxcoalesce", {})
    ov, pred = v.get("inductor-overlap"), fx.get("report_predicted_comm_us")
    if not pred or not ov or not ov.get("all_reduce_launches") or not rec.get("profile"):
        return None
    program = sum(r["bytes_before"] for r in fx.get("report_all_reduce") or ())
    if ov.get("bytes") != program:
        return None
    path = Path(rec["profile"])
    if not path.is_file():
        return None
    from fxcoalesce.config import CostModel
    cost = CostModel.from_profile(path)
    launches = ov["all_reduce_launches"]
    before = launches * cost.all_reduce_us(ov["bytes"] // launches, rec.get("tp", 2))
    return (before - sum(p["after"]["exposed"] for p in pred)) / 1e3


def rows(records: list[dict]) -> list[dict]:
    out = []
    for rec in records:
        v = rec["variants"]
        base = v.get("inductor")
        if base is None:
            continue
        row = {"model": rec["model"], "step": rec["step"], "dim": rec.get("dim"),
               "tokens": rec["tokens"], "torch": rec["torch"]}
        for name, r in v.items():
            row[name] = {"median_ms": r["median_ms"], "p10_ms": r["p10_ms"],
                         "p90_ms": r["p90_ms"], "bytes": r.get("bytes"),
                         "launches": r.get("all_reduce_launches"),
                         "steps_ms": r.get("steps_ms")}
        fx, ov = v.get("fxcoalesce"), v.get("inductor-overlap")
        if fx is not None:
            row["measured_gain_ms"] = measured_gain_ms(fx, base)
            row["predicted_gain_ms"] = predicted_gain_ms(rec)
            row["fx_beats_inductor"] = faster(fx, base)
        if fx is not None and ov is not None:
            row["fx_vs_overlap"] = ov["median_ms"] / fx["median_ms"]
            row["fx_beats_overlap"] = faster(fx, ov)
            row["overlap_beats_fx"] = faster(ov, fx)
            pair = paired(fx, ov)
            if pair:
                row["fx_faster_rounds_vs_overlap"] = f"{pair[1]}/{pair[2]}"
            row["measured_gain_vs_overlap_ms"] = measured_gain_ms(fx, ov)
            row["predicted_gain_vs_overlap_ms"] = predicted_gain_vs_overlap_ms(rec)
        out.append(row)
    return out


def crossover(table: list[dict]) -> list[str]:
    """Per (model, step, hidden): the smallest token count from which fxcoalesce beats the
    overlap scheduler beyond the noise at every larger count measured."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    for r in table:
        groups.setdefault((r["model"], r["step"], r["dim"]), []).append(r)
    for (model, step, dim), rs in groups.items():
        rs = sorted((r for r in rs if "fx_vs_overlap" in r), key=lambda r: r["tokens"])
        if not rs:
            continue
        start = None
        for i, r in enumerate(rs):
            if all(x["fx_beats_overlap"] for x in rs[i:]):
                start = r
                break
        ratios = ", ".join(f"{r['tokens']}: {r['fx_vs_overlap']:.2f}x"
                           + (f" ({r['fx_faster_rounds_vs_overlap']} rounds)"
                              if "fx_faster_rounds_vs_overlap" in r else "") for r in rs)
        where = (f"from {start['tokens']} tokens on" if start else
                 "at no size measured")
        lines.append(f"{model} {step}, hidden {dim}: fxcoalesce beats the overlap scheduler "
                     f"beyond the noise (sign test over rounds, p < 0.01) {where} (its "
                     f"speed-up by tokens, and the rounds it was faster in: {ratios})")
    return lines


def markdown(table: list[dict], command: str) -> str:
    names = [n for n in VARIANTS.split(",") if any(n in r for r in table)]
    head = ("| model | step | hidden | tokens | " + " | ".join(f"{n} ms (p10-p90)" for n in names)
            + " | bytes prog -> fx | fx vs overlap | gain vs overlap measured / predicted ms"
            + " | gain vs plain measured / predicted ms |")
    lines = [f"Command: `{command}`", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in table:
        cells = [f"{r[n]['median_ms']:.2f} ({r[n]['p10_ms']:.2f}-{r[n]['p90_ms']:.2f})"
                 if n in r else "-" for n in names]
        byt = (f"{r['inductor']['bytes']} -> {r['fxcoalesce']['bytes']}"
               if "fxcoalesce" in r else "-")
        vs = f"{r['fx_vs_overlap']:.2f}x" if "fx_vs_overlap" in r else "-"
        gains = [gain_cell(r, "_vs_overlap"), gain_cell(r, "")]
        lines.append(f"| {r['model']} | {r['step']} | {r['dim']} | {r['tokens']} | "
                     + " | ".join(cells) + f" | {byt} | {vs} | " + " | ".join(gains) + " |")
    return "\n".join(lines + ["", *("- " + c for c in crossover(table)),
                              "- " + model_check(table, "_vs_overlap"),
                              "- " + model_check(table)]) + "\n"


def gain_cell(r: dict, which: str) -> str:
    m, p = r.get(f"measured_gain{which}_ms"), r.get(f"predicted_gain{which}_ms")
    return "-" if m is None or p is None else f"{m:+.2f} / {p:+.2f}"


def model_check(table: list[dict], which: str = "", within: float = 0.25) -> str:
    """How often the cost model's predicted gain lies within ``within`` of the measured one
    (the median of the rounds' differences), over the rows where fxcoalesce is faster beyond
    the noise (elsewhere there is no measured gain to compare with). ``which``: "" against
    plain Inductor (whose code hides kernels under collectives the model counts as exposed),
    "_vs_overlap" against the overlap scheduler (the crossover's comparison)."""
    pk, mk = f"predicted_gain{which}_ms", f"measured_gain{which}_ms"
    won = "fx_beats_overlap" if which else "fx_beats_inductor"
    judged = [r for r in table if r.get(pk) is not None and r.get(mk) is not None
              and r.get(won)]
    good = [r for r in judged if abs(r[pk] - r[mk]) <= within * r[mk]]
    sizes = ", ".join(f"{r['model']} d{r['dim']} {r['tokens']} tok: "
                      f"{r[pk]:+.1f} / {r[mk]:+.1f} ms" for r in judged)
    against = "the overlap scheduler" if which else "plain"
    return (f"cost model within {within:.0%} of the measured gain at {len(good)} of the "
            f"{len(judged)} sizes where it is faster than {against} beyond the noise"
            + (f" (predicted / measured: {sizes})" if judged else ""))


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in table:
        groups.setdefault((r["model"], r["step"], r["dim"]), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, ((model, step, dim), rs) in zip(axes[0], groups.items()):
        rs = sorted(rs, key=lambda r: r["tokens"])
        x = [r["tokens"] for r in rs]
        for name in VARIANTS.split(","):
            if not all(name in r for r in rs):
                continue
            y = [r["inductor"]["median_ms"] / r[name]["median_ms"] for r in rs]
            lo = [r["inductor"]["median_ms"] / r[name]["p90_ms"] for r in rs]
            hi = [r["inductor"]["median_ms"] / r[name]["p10_ms"] for r in rs]
            ax.plot(x, y, marker="o", label=name)
            ax.fill_between(x, lo, hi, alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"{model} {step}, hidden {dim}")
        ax.set_xlabel("tokens per step")
        ax.set_ylabel("speed-up vs plain Inductor (median; band: p10-p90)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per bench run")
    ap.add_argument("--only", help="run only the cases of this model")
    ap.add_argument("--dims", help="run only these hidden sizes (comma-separated)")
    ap.add_argument("--tokens", help="these token counts instead of each case's own")
    ap.add_argument("--summarize-only", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/sweep_sizes.py " + " ".join(argv or sys.argv[1:])
    if not args.summarize_only:
        for model, step, dim, tokens, layers in CASES:
            if (args.only and model != args.only) or (
                    args.dims and str(dim) not in args.dims.split(",")):
                continue
            run_case(model, step, dim, args.tokens or tokens, layers, args, out)
    records = [rec for f in sorted(out.glob("*/bench.json")) for rec in json.loads(f.read_text())]
    table = rows(records)
    if not table:
        print(f"no bench results under {out}/*/bench.json", file=sys.stderr)
        return 1
    (out / "sweep.json").write_text(json.dumps(table, indent=1))
    (out / "sweep.md").write_text(markdown(table, command))
    plot(table, out / "sweep.png")
    print((out / "sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
