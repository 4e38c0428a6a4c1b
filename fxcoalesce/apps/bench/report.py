"""What ``fxcoalesce bench`` writes: ``bench.json`` (a list with one record per token
count), ``bench.md`` (a markdown table per record) and ``bench.png`` (bar chart, p10-p90
whiskers), and the table it prints. Pure functions of the records: no torch.

A record: ``{"model", "step", "tp", "tokens", "layers", "backend", "device", "cudagraphs",
"nccl_mode", "torch", "gpu", "driver", "nccl", "profile", "date", ..., "variants": {NAME:
{"median_ms", "p10_ms", "p90_ms", "all_reduce_launches", "bytes", "max_abs_err",
"exposed_comm_ms" (when no-comm ran), "wrong_by_design" (no-comm), "lowered",
"hidden_kernels" (per all_reduce of the generated code, the kernels under it), ...}},
"skipped": {NAME: why}, "notes": [...]}`` (``records.py`` makes them). The ``no-comm``
variant is wrong by design: its row says so in the error column, its bar is hatched red with
the floor drawn across the panel, and the table gains an "exposed comm ms" column.

A speed-up is *within noise* when the variant's p10-p90 range overlaps the reference's
(``within_noise``): the table says so beside it, ``bench.json`` holds it per variant
(``within_noise_of_inductor``, ``records.py``) and its bar is drawn pale. Where the rounds'
steps are kept (``steps_ms``), "faster beyond the noise" is judged round by round instead
(``paired``, ``sign_test``, ``faster``): each round runs every variant once, so a round's
steps share its load, which a shared machine's noise keeps the ranges from showing.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from fxcoalesce.apps.bench.compile_timing import HOW

BASELINE = "inductor"
NOISE = "within noise"


def uncalibrated(device: str) -> str:
    """What a prediction of the default cost model says where it is printed."""
    return (f"default, uncalibrated: all_reduce as a ring over PCIe (NCCL's latencies, 20 GB/s), "
            f"compute as a {device.upper()} roofline (fxcoalesce.cost.DEVICE_DEFAULTS); "
            "`fxcoalesce calibrate` measures this machine")


def ranges_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether the closed ranges ``a`` and ``b`` (low, high) share a point."""
    return a[0] <= b[1] and b[0] <= a[1]


def within_noise(v: dict, ref: dict) -> bool:
    """Whether variant ``v``'s p10-p90 step time overlaps the reference ``ref``'s: a
    difference of medians that the spread of either covers."""
    return ranges_overlap((v["p10_ms"], v["p90_ms"]), (ref["p10_ms"], ref["p90_ms"]))


ALPHA = 0.01
"""A variant is faster beyond the noise where the sign test's p is below this (13 of 15
rounds, 40 of 60)."""


def paired(a: dict, b: dict) -> tuple[float, int, int] | None:
    """Round by round, b's step minus a's (ms): their median, the rounds in which a was
    faster, and the rounds; None where the steps were not kept."""
    sa, sb = a.get("steps_ms"), b.get("steps_ms")
    if not sa or not sb or len(sa) != len(sb):
        return None
    d = [y - x for x, y in zip(sa, sb)]
    return statistics.median(d), sum(v > 0 for v in d), len(d)


def sign_test(k: int, n: int) -> float:
    """One-sided sign test: the chance of ``k`` or more wins in ``n`` rounds where neither
    side is faster (a tie counts as no win)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def faster(a: dict, b: dict, alpha: float = ALPHA) -> bool:
    """a faster than b beyond the noise: a one-sided sign test over the rounds (paired by
    round) gives p < ``alpha``; without kept steps, a's p10-p90 range wholly below b's."""
    p = paired(a, b)
    if p is None:
        return a["p90_ms"] < b["p10_ms"]
    _, k, n = p
    return sign_test(k, n) < alpha


def title(rec: dict) -> str:
    layers = (f", {rec['layers']} layers" if rec.get("layers") else "") + (
        f", hidden {rec['dim']}" if rec.get("dim") else "")
    mode = f", NCCL {rec['nccl_mode']}" if rec.get("nccl_mode") else ""
    graphs = "CUDA graphs" if rec["cudagraphs"] else "no CUDA graphs"
    gpu = f" {rec['gpu']}" if rec.get("gpu") else ""
    return (f"{rec['model']}{layers} {rec['step']}, {rec['tokens']} tokens, TP {rec['tp']} "
            f"({rec['backend']}{mode}, {rec['device']}{gpu}, {rec.get('dtype', '')}, {graphs})")


def _speedup(rec: dict, name: str) -> str:
    """'1.37x', with ' (within noise)' when the ranges overlap the baseline's."""
    base = rec["variants"].get(BASELINE)
    v = rec["variants"][name]
    if not base or not v["median_ms"]:
        return "-"
    noisy = name != BASELINE and within_noise(v, base)
    return f"{base['median_ms'] / v['median_ms']:.2f}x" + (f" ({NOISE})" if noisy else "")


def noise_remarks(rec: dict) -> list[str]:
    """What "within noise" means, when a row says it, and fxcoalesce against each other
    compiled variant whose range overlaps its own."""
    vs = rec["variants"]
    lines = []
    if BASELINE in vs and any(n != BASELINE and within_noise(v, vs[BASELINE])
                              for n, v in vs.items()):
        lines.append(f"{NOISE}: the variant's p10-p90 step time overlaps {BASELINE}'s, so "
                     "the spread covers the difference of the medians")
    ours = vs.get("fxcoalesce")
    for name, v in vs.items():
        if ours is None or name in ("fxcoalesce", BASELINE, "eager") or v.get(
                "wrong_by_design") or not within_noise(ours, v):
            continue
        lines.append(f"fxcoalesce vs {name}: {ours['median_ms']:.3f} against "
                     f"{v['median_ms']:.3f} ms median, p10-p90 ranges overlap: {NOISE}")
    return lines


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


HEADER = ("variant", "median ms", "p10 ms", "p90 ms", f"vs {BASELINE}", "all_reduce launches",
          "bytes reduced", "kernels hidden", "max abs err", "compile s")
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


def _hidden(v: dict) -> str:
    """Kernels the generated code launches under its all_reduces, in all ('-': not compiled)."""
    hidden = v.get("hidden_kernels")
    return "-" if hidden is None else str(sum(hidden))


def _error(v: dict) -> str:
    err = f"{v['max_abs_err']:.3g}"
    return f"{err} (wrong by design)" if v.get("wrong_by_design") else err


def rows(rec: dict) -> list[tuple[str, ...]]:
    exposed = EXPOSED in header(rec)
    out = []
    for name, v in rec["variants"].items():
        cells = [name, f"{v['median_ms']:.3f}", f"{v['p10_ms']:.3f}", f"{v['p90_ms']:.3f}",
                 _speedup(rec, name), _launches(v), _bytes(v["bytes"]), _hidden(v), _error(v)]
        if exposed:
            cells.append(f"{v['exposed_comm_ms']:.3f}" if "exposed_comm_ms" in v else "-")
        out.append((*cells, f"{v.get('compile_s', 0):.1f}"))
    return out


def remarks(rec: dict) -> list[str]:
    """Skipped variants, warnings, and what a TP of 1 means."""
    lines = ["columns: a step's time over the rounds (the slowest rank's); launches and bytes "
             "counted at run time; kernels hidden: compute kernels the generated code runs "
             "between an all_reduce's launch and its wait; max abs err: against eager"]
    lines += [f"{name}: skipped ({why})" for name, why in rec.get("skipped", {}).items()]
    lines += rec.get("notes", [])
    lines += noise_remarks(rec)
    if said := _compile_caches(rec):
        lines.append(f"compile s: {HOW}; {said}")
    if (g := rec.get("gain")) and g["error"] is not None and g["model"] == "default":
        lines.append(f"fxcoalesce vs inductor: measured {g['measured_ms']:+.3f} ms a step; the "
                     "default cost model is not calibrated for this machine, so its "
                     "prediction is not compared (`fxcoalesce calibrate --out p.json`, then "
                     "`--profile p.json`)")
    elif g and g["error"] is not None:
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


def _compile_caches(rec: dict) -> str:
    """What Inductor's cache did for each compiled variant, in a clause ("" if unknown)."""
    states = {n: v["compile_cache"] for n, v in rec["variants"].items()
              if v.get("compile_cache")}
    if len(set(states.values())) == 1:
        return f"the cache was {next(iter(states.values()))} for every compiled variant"
    return ("caches differ, so compile times do not compare: " if states else "") + ", ".join(
        f"{n} {s}" for n, s in states.items())


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
    """Bar chart of median step time per variant, one panel per record, whiskers p10-p90,
    pale bars (and their labels) for variants within noise of the baseline; returns why it
    was not written (matplotlib missing), else None."""
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
        base = rec["variants"].get(BASELINE)
        noisy = [n != BASELINE and base is not None and within_noise(x, base)
                 for n, x in zip(names, v)]
        bars = ax.bar(range(len(names)), med, yerr=err, capsize=3, color=colors)
        for bar, x, pale in zip(bars, v, noisy):
            if pale:  # its range overlaps the baseline's: no difference to read off the bar
                bar.set_alpha(0.4)
            if x.get("wrong_by_design"):  # the floor: hatched, and drawn across the panel
                bar.set_hatch("//")
                ax.axhline(x["median_ms"], color="tab:red", linestyle="--", linewidth=0.8)
        labels = [f"{n}\n{x['all_reduce_launches']} all_reduces"
                  + ("\nWRONG BY DESIGN" if x.get("wrong_by_design") else "")
                  + (f"\n{NOISE} of {BASELINE}" if pale else "")
                  for n, x, pale in zip(names, v, noisy)]
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
