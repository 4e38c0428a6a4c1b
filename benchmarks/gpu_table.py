"""The GPU bench matrix as one table and one chart, from the records `gpu_bench.sh` writes.

    python benchmarks/gpu_table.py benchmarks/results/gpu_h200x2_2026-11-30/results.jsonl \
        [--png matrix.png]

One row per (model, tokens, CUDA graphs, NCCL mode): each variant's median step time,
fxcoalesce's speed-up over plain Inductor and over the best other compiled variant, the
all_reduce launches executed (counted at run time), and the report's predicted gain next to
the measured one. Records of a run that did not finish are never written, so every row is a
finished measurement. `--compact` prints gpu_bench.sh's per-variant listing instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COMPILED = ("inductor", "inductor-bucketing", "inductor-one-shot", "hand-merged", "fxcoalesce")
"""The real competitors (no-comm, wrong by design, is none: it is the floor)."""
SHORT = {"falcon-40b": "falcon-40b 4L", "kimi-k2": "kimi-k2 3L"}


def load(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _key(rec: dict):
    order = ["llama-3-8b", "falcon-40b", "kimi-k2", "neox-tiny", "kimi-k2-tiny"]
    m = order.index(rec["model"]) if rec["model"] in order else len(order)
    return (not rec["cudagraphs"], m, rec["nccl_mode"] or "", rec["tokens"])


def row(rec: dict) -> dict:
    v = rec["variants"]
    med = {n: v[n]["median_ms"] for n in COMPILED if n in v}
    fx = med.get("fxcoalesce")
    others = [med[n] for n in COMPILED if n in med and n != "fxcoalesce"]
    gain = rec.get("gain") or {}
    return {
        "model": SHORT.get(rec["model"], rec["model"]), "tokens": rec["tokens"],
        "graphs": "on" if rec["cudagraphs"] else "off", "nccl": rec["nccl_mode"] or rec["backend"],
        **{n: med.get(n) for n in COMPILED},
        "vs_inductor": med["inductor"] / fx if fx and "inductor" in med else None,
        "vs_best_other": min(others) / fx if fx and others else None,
        "launches": (f"{v['inductor']['all_reduce_launches']} → "
                     f"{v['fxcoalesce']['all_reduce_launches']}"
                     if "inductor" in v and "fxcoalesce" in v else "-"),
        "predicted_ms": gain.get("predicted_ms"), "measured_ms": gain.get("measured_ms"),
    }


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(records: list[dict]) -> str:
    head = ("| model | tokens | CUDA graphs | NCCL | inductor | inductor-bucketing | "
            "inductor-one-shot | hand-merged | fxcoalesce | vs inductor | vs best other | "
            "launches | gain predicted / measured (ms) | exposed comm, fxcoalesce / inductor |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in sorted(records, key=_key):
        r = row(rec)
        gain = (f"{_ms(r['predicted_ms'])} / {_ms(r['measured_ms'])}"
                if r["measured_ms"] is not None else "-")
        v = rec["variants"]
        exposed = (f"{v['fxcoalesce']['exposed_comm_ms'] / v['inductor']['exposed_comm_ms']:.0%}"
                   if "exposed_comm_ms" in v.get("fxcoalesce", {}) and
                   v.get("inductor", {}).get("exposed_comm_ms") else "-")
        ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['graphs']} | {r['nccl']} | "
            + " | ".join(_ms(r[n]) for n in COMPILED)
            + f" | {ratio(r['vs_inductor'])} | {ratio(r['vs_best_other'])} | {r['launches']} | "
              f"{gain} | {exposed} |")
    return "\n".join(lines)


def compact(records: list[dict]) -> str:
    """Every variant of every record, one line each (gpu_bench.sh's closing table)."""
    lines = ["| run | model | tokens | graphs | NCCL | variant | median ms | p10 | p90 | "
             "vs inductor | all_reduces | exposed comm ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        base = r["variants"].get("inductor", {}).get("median_ms")
        for name, v in r["variants"].items():
            x = f"{base / v['median_ms']:.2f}x" if base else "-"
            flag = " (wrong by design)" if v.get("wrong_by_design") else ""
            exposed = f"{v['exposed_comm_ms']:.3f}" if "exposed_comm_ms" in v else "-"
            lines.append(
                f"| {r.get('run', '-')} | {r['model']} | {r['tokens']} | "
                f"{'on' if r['cudagraphs'] else 'off'} | {r['nccl_mode'] or r['backend']} | "
                f"{name}{flag} | {v['median_ms']:.3f} | {v['p10_ms']:.3f} | {v['p90_ms']:.3f} | "
                f"{x} | {v['all_reduce_launches']} | {exposed} |")
    return "\n".join(lines) if records else "(no results)"


def chart(records: list[dict], path: str | Path) -> None:
    """Speed-up over plain Inductor of each compiled variant, one group of bars per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = sorted(records, key=_key)
    names = [n for n in COMPILED if n != "inductor"]
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(recs)), 4.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, rec in enumerate(recs):
            v = rec["variants"]
            if name in v and "inductor" in v:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(v["inductor"]["median_ms"] / v[name]["median_ms"])
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    tag = {"llama-3-8b": "llama8b", "falcon-40b": "falcon", "kimi-k2": "kimi",
           "neox-tiny": "neox-t",
           "kimi-k2-tiny": "kimi-t"}
    labels = [f"{tag.get(r['model'], r['model'])}\nT{r['tokens']}\n"
              f"{'CG' if r['cudagraphs'] else 'no CG'}\n{r['nccl_mode']}" for r in recs]
    ax.set_xticks(range(len(recs)), labels, fontsize=7)
    ax.set_ylabel("speed-up over plain torch.compile")
    lo = min(0.9, *(b.get_height() for b in ax.patches))
    ax.set_ylim(lo, None)
    tps = sorted({r["tp"] for r in recs})
    ax.set_title(f"verify step, TP {'/'.join(map(str, tps))} (NCCL), median of interleaved rounds")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="results.jsonl (one bench.json record per line)")
    p.add_argument("--png", help="write the speed-up chart here")
    p.add_argument("--compact", action="store_true", help="one line per variant instead")
    a = p.parse_args(argv)
    records = load(a.results)
    print(compact(records) if a.compact else markdown(records))
    if a.png:
        chart(records, a.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
