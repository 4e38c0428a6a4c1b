"""What ``fxcoalesce bench`` writes: ``bench.json`` (a list with one record per token
count), ``bench.md`` (a markdown table per record) and ``bench.png`` (bar chart, p10-p90
whiskers), and the table it prints. Pure functions of the records: no torch.

A record: ``{"model", "step", "tp", "tokens", "layers", "backend", "device", "cudagraphs",
"nccl_mode", "torch", "gpu", "driver", "nccl", "profile", "date", ..., "variants": {NAME:
{"median_ms", "p10_ms", "p90_ms", "all_reduce_launches", "bytes", "max_abs_err",
"exposed_comm_ms" (when no-comm ran), "wrong_by_design" (no-comm), "lowered", ...}},
"skipped": {NAME: why}, "notes": [...]}`` (``records.py`` makes them). The ``no-comm``
variant is wrong by design: its row says so in the error column, its bar is hatched red with
the floor drawn across the panel, and the table gains an "exposed comm ms" column.
"""

from __future__ import annotations

import json
from pathlib import Path

BASELINE = "inductor"


def title(rec: dict) -> str:
    layers = f", {rec['layers']} layers" if rec.get("layers") else ""
    mode = f", NCCL {rec['nccl_mode']}" if rec.get("nccl_mode") else ""
    graphs = "CUDA graphs" if rec["cudagraphs"] else "no CUDA graphs"
    gpu = f" {rec['gpu']}" if rec.get("gpu") else ""
    return (f"{rec['model']}{layers} {rec['step']}, {rec['tokens']} tokens, TP {rec['tp']} "
            f"({rec['backend']}{mode}, {rec['device']}{gpu}, {rec.get('dtype', '')}, {graphs})")


def _speedup(rec: dict, name: str) -> str:
    base = rec["variants"].get(BASELINE)
    v = rec["variants"][name]
    return f"{base['median_ms'] / v['median_ms']:.2f}x" if base and v["median_ms"] else "-"


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


HEADER = ("variant", "median ms", "p10 ms", "p90 ms", f"vs {BASELINE}", "all_reduce launches",
          "bytes reduced", "max abs err", "compile s")
EXPOSED = "exposed comm ms"
"""The column shown when the no-comm floor ran: each variant's median minus the floor's."""


def header(rec: dict) -> tuple[str, ...]:
    if not any("exposed_comm_ms" in v for v in rec["variants"].values()):
        return HEADER
    return (*HEADER[:-1], EXPOSED, HEADER[-1])


def _launches(v: dict) -> str:
    """'9', or '9 (9 one_shot)' when some ran as a lowered implementation."""
    lowered = ", ".join(f"{n} {impl}" for impl, n in (v.get("lowered") or {}).items() if n)
    return f"{v['all_reduce_launches']}" + (f" ({lowered})" if lowered else "")


def _error(v: dict) -> str:
    err = f"{v['max_abs_err']:.3g}"
    return f"{err} (wrong by design)" if v.get("wrong_by_design") else err


def rows(rec: dict) -> list[tuple[str, ...]]:
    exposed = EXPOSED in header(rec)
    out = []
    for name, v in rec["variants"].items():
        cells = [name, f"{v['median_ms']:.3f}", f"{v['p10_ms']:.3f}", f"{v['p90_ms']:.3f}",
                 _speedup(rec, name), _launches(v), _bytes(v["bytes"]), _error(v)]
        if exposed:
            cells.append(f"{v['exposed_comm_ms']:.3f}" if "exposed_comm_ms" in v else "-")
        out.append((*cells, f"{v.get('compile_s', 0):.1f}"))
    return out


def remarks(rec: dict) -> list[str]:
    """Skipped variants, warnings, and what a TP of 1 means."""
    lines = [f"{name}: skipped ({why})" for name, why in rec.get("skipped", {}).items()]
    lines += rec.get("notes", [])
    if (g := rec.get("gain")) and g["error"] is not None:
        lines.append(f"fxcoalesce vs inductor: measured {g['measured_ms']:+.3f} ms a step, the "
                     f"report predicted {g['predicted_ms']:+.3f} ms ({g['error']:+.0%}; cost "
                     f"model: {g['model']})")
    for name, v in rec["variants"].items():
        if t := v.get("trace"):
            lines.append(f"{name}, profiler trace ({t['source']}, {t['file']}): collectives "
                         f"{t['collective_us']:.1f} µs a step, {t['exposed_us']:.1f} µs of it "
                         f"under no compute; {t['compute_spans']:g} compute spans a step")
    if rec["tp"] == 1:
        lines.append("TP 1: one rank, so no all_reduce moves data and nothing can be merged; "
                     "the variants differ only in how the step is compiled")
    return lines


def text_table(rec: dict) -> str:
    table = [header(rec), *rows(rec)]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    fmt = lambda r: "  " + "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines = [title(rec), *map(fmt, table)]
    lines += [f"  note: {line}" for line in remarks(rec)]
    return "\n".join(lines)


def markdown(records: list[dict]) -> str:
    parts = []
    for rec in records:
        parts.append(f"### {title(rec)}\n")
        parts.append("| " + " | ".join(header(rec)) + " |")
        parts.append("|" + "---|" * len(header(rec)))
        parts += ["| " + " | ".join(r) + " |" for r in rows(rec)]
        parts.append("")
        parts += [f"- {line}" for line in remarks(rec)]
        k = rec.get("calls_per_sample", 1)
        per = f" ({k} calls back to back per sample, divided by {k})" if k > 1 else ""
        parts.append(f"\n{rec['steps']} timed rounds after {rec['warmup']} warm-up{per}; a "
                     "step's time is its slowest rank's; all_reduce launches counted at run time "
                     f"(profiler); {provenance(rec)}. Command: `{rec.get('command', '')}`\n")
    return "\n".join(parts)


def provenance(rec: dict) -> str:
    """torch, GPU, driver, NCCL, the cost profile and the date of a record."""
    parts = [f"torch {rec['torch']}"]
    if rec.get("gpu"):
        parts.append(f"{rec.get('gpus', 1)}x {rec['gpu']}, driver {rec.get('driver') or '?'}, "
                     f"NCCL {rec.get('nccl') or '?'}")
    parts += [f"cost profile {rec.get('profile', 'default')}", rec["date"]]
    return ", ".join(parts)


def write_png(records: list[dict], path: Path) -> str | None:
    """Bar chart of median step time per variant, one panel per record, whiskers p10-p90;
    returns why it was not written (matplotlib missing), else None."""
    try:
        import matplotlib
    except ImportError:
        return ("bench.png needs matplotlib, which is not installed "
                "(pip install 'fxcoalesce[plot]'); bench.json and bench.md are written")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(records), figsize=(2.2 + 2.4 * len(records), 4.2),
                             squeeze=False)
    for ax, rec in zip(axes[0], records):
        names = list(rec["variants"])
        v = [rec["variants"][n] for n in names]
        med = [x["median_ms"] for x in v]
        err = [[m - x["p10_ms"] for m, x in zip(med, v)],
               [x["p90_ms"] - m for m, x in zip(med, v)]]
        colors = ["tab:green" if n == "fxcoalesce" else "tab:red" if x.get("wrong_by_design")
                  else "tab:gray" for n, x in zip(names, v)]
        bars = ax.bar(range(len(names)), med, yerr=err, capsize=3, color=colors)
        for bar, x in zip(bars, v):
            if x.get("wrong_by_design"):  # the floor: hatched, and drawn across the panel
                bar.set_hatch("//")
                ax.axhline(x["median_ms"], color="tab:red", linestyle="--", linewidth=0.8)
        labels = [f"{n}\n{x['all_reduce_launches']} all_reduces"
                  + ("\nWRONG BY DESIGN" if x.get("wrong_by_design") else "")
                  for n, x in zip(names, v)]
        ax.set_xticks(range(len(names)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{rec['tokens']} tokens", fontsize=9)
        ax.set_ylabel("step time, ms (median, p10-p90)")
    rec = records[0]
    fig.suptitle(title(rec).replace(f", {rec['tokens']} tokens", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_all(records: list[dict], out: str | Path) -> list[str]:
    """Write bench.json, bench.md and bench.png into ``out``; returns messages to show."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(records, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(records))
    skipped = write_png(records, out / "bench.png")
    written = "bench.json, bench.md" + ("" if skipped else ", bench.png")
    return [f"wrote {written} in {out}"] + ([skipped] if skipped else [])
