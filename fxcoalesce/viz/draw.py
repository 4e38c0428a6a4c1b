"""Drawings for ``fxcoalesce inspect``: the collective picture as SVG or PNG (Graphviz's
``dot`` when it is installed, else matplotlib) and two-lane timelines (matplotlib), either
predicted (``fxcoalesce.viz.timeline``) or read from a torch.profiler chrome trace.

matplotlib is optional (``pip install 'fxcoalesce[plot]'``); it is imported only here, and
drawing uses ``matplotlib.figure.Figure`` directly, so no pyplot state or GUI backend.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

from fxcoalesce.viz.picture import Panel, to_dot
from fxcoalesce.viz.timeline import Span, Timeline, merged, overlaps

NEEDS_A_RENDERER = ("drawing {fmt} needs Graphviz's `dot` on PATH or matplotlib "
                    "(pip install 'fxcoalesce[plot]'); --format dot writes the DOT text "
                    "without either")
NEEDS_MATPLOTLIB = "{what} needs matplotlib (pip install 'fxcoalesce[plot]')"
COMM_NAME = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
                       r"broadcast|c10d|gloo", re.IGNORECASE)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
COMPUTE_COLOURS = ("#4c72b0", "#8fa9d6")
EXPOSED, HIDDEN = "#c44e52", "#55a868"


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def renderer() -> str | None:
    """What draws SVG/PNG here: "dot" (Graphviz) if on PATH, else "matplotlib", else None."""
    if shutil.which("dot"):
        return "dot"
    return "matplotlib" if has_matplotlib() else None


def render_picture(panels: list[Panel], path: str | Path, fmt: str, *, title: str = "",
                   engine: str | None = None) -> str:
    """Write ``panels`` to ``path`` as ``fmt`` ("svg" or "png"); returns the engine used."""
    engine = engine or renderer()
    if engine == "dot":
        subprocess.run(["dot", f"-T{fmt}", "-o", str(path)], input=to_dot(panels, title),
                       text=True, check=True, capture_output=True)
    elif engine == "matplotlib":
        picture_figure(panels, title).savefig(Path(path), format=fmt, dpi=110,
                                              bbox_inches="tight")
    else:
        raise RuntimeError(NEEDS_A_RENDERER.format(fmt=fmt))
    return engine


def picture_figure(panels: list[Panel], title: str = ""):
    """The matplotlib ``Figure`` of a layered drawing: a panel per graph, one row per
    dependency depth, boxes in issue order."""
    from matplotlib.figure import Figure

    rows = [sorted({b.depth for b in p.boxes}) for p in panels]
    widest = max((sum(b.depth == d for b in p.boxes) for p, r in zip(panels, rows) for d in r),
                 default=1)
    tallest = max((len(r) for r in rows), default=1)
    lines = max((len(b.lines) for p in panels for b in p.boxes), default=1)
    # a panel as wide as its widest row of boxes and its title (~0.08 in a character at 9 pt),
    # a row as tall as its boxes' lines (7 pt) and an arrow; titles laid out by matplotlib's
    # constrained layout, so that a tall drawing keeps no blank band under the suptitle
    title_in = 0.08 * max((len(t) for p in panels for t in p.title.split("\n")), default=0)
    width = max(3.0, 2.0 * widest, title_in + 0.3)
    fig = Figure(figsize=(len(panels) * width, max(3.0, (0.22 + 0.13 * lines) * tallest + 1)),
                 layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel, depths in zip(axes, panels, rows):
        row_of = {d: i for i, d in enumerate(depths)}
        texts = {}
        for d in depths:
            row = [b for b in panel.boxes if b.depth == d]
            for j, b in enumerate(row):
                x = j - (len(row) - 1) / 2
                texts[b.id] = ax.text(
                    x, -row_of[d], "\n".join(b.lines), ha="center", va="center", fontsize=7,
                    bbox={"boxstyle": "round,pad=0.4", "fc": b.colour or "white", "ec": "#333"})
        for a, b in panel.edges:
            ta, tb = texts[a], texts[b]
            ax.annotate("", xy=tb.get_position(), xytext=ta.get_position(),
                        arrowprops={"arrowstyle": "->", "color": "#555", "lw": 0.8,
                                    "patchA": ta.get_bbox_patch(),
                                    "patchB": tb.get_bbox_patch()})
        ax.set_xlim(-widest / 2 - 0.1, widest / 2 + 0.1)
        ax.set_ylim(-len(depths) + 0.4, 0.6)
        ax.set_title(panel.title, fontsize=9)
        ax.axis("off")
    if title:
        fig.suptitle(title)
    return fig


def draw_timelines(timelines: list[Timeline], path: str | Path, *, unit: str = "µs") -> None:
    """One panel per timeline, two lanes each: compute (nodes alternately shaded so they
    stay distinct) and communication (exposed in red, hidden under compute in green)."""
    timeline_figure(timelines, unit).savefig(Path(path), dpi=110, bbox_inches="tight")


def timeline_figure(timelines: list[Timeline], unit: str = "µs"):
    """The matplotlib ``Figure`` that :func:`draw_timelines` writes; its legend names what is
    drawn: each colour that appears, and only those; a predicted timeline's title says what
    the prediction assumes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 1.7 * len(timelines) + 0.9), layout="constrained")
    if assumes := "; ".join(dict.fromkeys(tl.assumes for tl in timelines if tl.assumes)):
        fig.suptitle(f"Predicted, not measured: {assumes}", fontsize=8, wrap=True)
    axes = fig.subplots(len(timelines), 1, squeeze=False, sharex=True)[:, 0]
    for ax, tl in zip(axes, timelines):
        bars = lambda spans: [(s.start_us, s.end_us - s.start_us) for s in spans]  # noqa: E731
        ax.broken_barh(bars(tl.compute), (0.6, 0.8),
                       facecolors=[COMPUTE_COLOURS[i % 2] for i in range(len(tl.compute))])
        # edges in the bar's own colour: a collective far shorter than the step stays visible
        ax.broken_barh(bars(tl.comm), (-0.4, 0.8), facecolors=EXPOSED, edgecolor=EXPOSED,
                       linewidth=0.5)
        ax.broken_barh(bars(tl.hidden), (-0.4, 0.8), facecolors=HIDDEN, hatch="//",
                       edgecolor="#2d6a3e", linewidth=0.5)
        ax.set_yticks([0, 1], ["communication", "compute"])
        ax.set_ylim(-0.7, 1.7)
        ax.set_title(tl.summary(), fontsize=9, loc="left")
    axes[-1].set_xlabel(unit)
    handles, labels, handler_map = _timeline_legend(timelines)
    fig.legend(handles, labels, handler_map=handler_map, loc="outside lower center",
               fontsize=8, ncols=max(len(handles), 1), frameon=False)
    return fig


def _timeline_legend(timelines: list[Timeline]) -> tuple[list, list[str], dict]:
    """Legend entries for what the timelines hold: the two compute shades as one entry, the
    exposed part of the collectives if any is left exposed, the hidden part if any is hidden."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.patches import Patch

    handles, labels = [], []
    if any(tl.compute for tl in timelines):
        shades = tuple(Patch(color=c) for c in COMPUTE_COLOURS)
        handles.append(shades)
        labels.append("compute (one bar per node, shades alternate)")
    if any(tl.comm_us - tl.hidden_us > 1e-9 for tl in timelines):
        handles.append(Patch(color=EXPOSED))
        labels.append("collective, exposed")
    if any(tl.hidden for tl in timelines):
        handles.append(Patch(facecolor=HIDDEN, hatch="//", edgecolor="#2d6a3e"))
        labels.append("collective, hidden under compute")
    return handles, labels, {tuple: HandlerTuple(ndivide=None, pad=0)}


def _leaves(events: list[dict]) -> list[dict]:
    """The events of each thread that contain no other event (the innermost ops)."""
    out = []
    threads: dict[tuple, list[dict]] = {}
    for e in events:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        for e, nxt in zip(evs, [*evs[1:], None]):
            if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]:
                out.append(e)
    return out


def read_chrome_trace(path: str | Path) -> Timeline:
    """Compute and collective spans of a chrome trace (``torch.profiler``'s
    ``export_chrome_trace``): GPU kernels when the trace has any (collectives are the NCCL
    kernels), else CPU ops (compute: the innermost ops; collectives: ops and annotations
    named like c10d / gloo / all_reduce ...)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--trace {path}: not a readable JSON file ({e})") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
             and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    if not spans:
        raise ValueError(f"--trace {path}: no complete ('ph': 'X') events; expected a chrome "
                         "trace from torch.profiler's export_chrome_trace")
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    is_comm = lambda e: bool(COMM_NAME.search(str(e.get("name", ""))))  # noqa: E731
    if gpu:
        compute, comm = [e for e in gpu if not is_comm(e)], [e for e in gpu if is_comm(e)]
    else:
        comm = [e for e in spans if is_comm(e)]
        compute = [e for e in _leaves([e for e in spans if e.get("cat") == "cpu_op"])
                   if not is_comm(e)]
    t0 = min(e["ts"] for e in compute + comm) if compute + comm else 0.0
    as_spans = lambda evs: [Span(str(e.get("name", "")), e["ts"] - t0,  # noqa: E731
                                 e["ts"] - t0 + e["dur"]) for e in evs]
    timeline = Timeline(f"{path.name} ({'GPU kernels' if gpu else 'CPU ops'})",
                        compute=as_spans(compute))
    timeline.comm = [Span("collectives", a, b) for a, b in merged(as_spans(comm))]
    timeline.hidden = overlaps(timeline.comm, merged(timeline.compute))
    return timeline
