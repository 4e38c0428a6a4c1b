"""Run the configured passes on a copy of an ATen graph, falling back on any failure."""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import logging
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist
from torch._logging import trace_structured
from torch.fx import Graph, GraphModule
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from .analysis import analyze
from .config import Config
from .collectives import group_setup, is_collective
from .meta import ORIGIN, REPLACES
from .report import Report, build_report, record

log = logging.getLogger("fxcoalesce")
_graph_ids = itertools.count()


def next_graph_name() -> str:
    """A process-unique name for the next compiled graph ("graph 0", "graph 1", ...)."""
    return f"graph {next(_graph_ids)}"


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule over a node-for-node copy of ``gm.graph`` (meta shared shallowly).

    Lazy: its Python code is generated only if someone reads or runs it (Inductor lowers
    the graph itself), which on a 10k-node graph saves most of the pipeline's time.
    """
    graph = Graph()
    out = graph.graph_copy(gm.graph, {})
    # Inductor keeps facts on the output node (user-visible outputs and their strides)
    graph.output(out).meta = copy.copy(gm.graph.output_node().meta)
    with _use_lazy_graph_module(True):
        return _make_graph_module(gm, graph)


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector: the pipeline allocates many small objects on top
    of a large heap (fake tensors, dynamo state), and a full collection triggered midway
    costs more than the whole pipeline. Nothing here makes long-lived cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run_pipeline(gm: GraphModule, cfg: Config, *, name: str | None = None, record: bool = True,
                 emit: bool = True) -> tuple[GraphModule, Report]:
    """Return the rewritten graph module and its report; ``gm`` itself is never modified.
    ``record=False``: the caller records the report (``report.record``) if it keeps the graph;
    ``emit=False``: nor are the trace artifacts and the dump written (the caller emits them
    for the graph it keeps: :func:`emit_graph`)."""
    with _gc_paused():
        return _run_pipeline(gm, cfg, name=name, record_report=record, emit=emit)


def emit_graph(cfg: Config, name: str, before: GraphModule, after: GraphModule,
               report: Report) -> None:
    """The structured-trace artifacts of a graph kept, and its dump (``cfg.dump_dir``)."""
    trace_artifacts(before, after, report)
    if cfg.dump_dir:
        dump(cfg.dump_dir, name, before, after, report)


def _run_pipeline(gm: GraphModule, cfg: Config, *, name: str | None, record_report: bool,
                  emit: bool) -> tuple[GraphModule, Report]:
    from fxcoalesce.passes import PASSES, check_config

    check_config(cfg)
    name = name or next_graph_name()
    t0 = time.perf_counter()
    before = analyze(gm)
    cfg.cost.check_setup(*group_setup(before.scan))  # a profile for another setup: raise
    analysis_ms = (time.perf_counter() - t0) * 1e3
    work = copy_graph_module(gm)
    for i, n in enumerate(n for n in work.graph.nodes if is_collective(n)):
        n.meta[ORIGIN] = f"#{i}"  # the program's own place: what ranks compare (meta.ORIGIN)
    timings, buckets, decisions, warnings = [], [], [], []
    fell_back, pass_name = False, None
    try:
        for pass_name in cfg.enabled_passes:
            result = _run_pass(pass_name, PASSES[pass_name], work, cfg, name, timings)
            buckets += [asdict(b) for b in result.buckets]
            decisions += [{"pass": pass_name, **d} for d in result.decisions]
            warnings += [f"{pass_name}: {w}" for w in result.warnings]
        pass_name = None
        work.recompile()
    except Exception as e:
        if cfg.strict:
            raise
        where = f"pass {pass_name!r} failed" if pass_name else "recompiling failed"
        log.warning("fxcoalesce[%s]: %s, using the unmodified graph: %r", name, where, e)
        warnings.append(f"{where}; fell back to the unmodified graph: {type(e).__name__}: {e}")
        work, buckets, decisions, fell_back = gm, [], [], True
    report = build_report(name, before, analyze(work), cost=cfg.cost, passes=timings,
                          buckets=buckets, decisions=decisions, warnings=warnings,
                          analysis_ms=analysis_ms, fell_back=fell_back)
    # everything this call cost: analyses, copy, passes, lint, report (not the dump below)
    report.total_ms = round((time.perf_counter() - t0) * 1e3, 3)
    if record_report:
        record(report)
    if emit:
        emit_graph(cfg, name, gm, work, report)
    return work, report


def _run_pass(pass_name: str, fn, work: GraphModule, cfg: Config, graph_name: str,
              timings: list[dict]):
    """One pass, the way every pass runs: timed, the graph linted after it (a pass that
    breaks the graph is named, not the one after it), and with ``cfg.dump_passes`` its graph
    written as ``after_<pass>.txt`` beside the graph's dump."""
    t = time.perf_counter()
    result = fn(work, cfg=cfg)
    work.graph.lint()
    timings.append({"name": pass_name, "ms": round((time.perf_counter() - t) * 1e3, 3),
                    "changed": result.changed})
    if cfg.dump_dir and cfg.dump_passes and result.changed:
        work.recompile()
        out = dump_directory(cfg.dump_dir, graph_name)
        (out / f"after_{pass_name}.txt").write_text(graph_text(work))
    return result


def trace_artifacts(before: GraphModule, after: GraphModule, report: Report) -> None:
    """The graphs, the report and the collective picture as structured-trace artifacts, so
    ``TORCH_TRACE=dir`` + ``tlparse`` show them next to Inductor's own. Costs a few calls
    when tracing is off: ``trace_structured`` calls no ``payload_fn`` then."""
    from .viz.picture import graph_dot

    dot = lambda: graph_dot(before, after, title=report.graph,  # noqa: E731
                            bound=report.all_reduce["lower_bound"])
    for name, encoding, payload in (
            ("fxcoalesce_before", "string", lambda: graph_text(before)),
            ("fxcoalesce_after", "string", lambda: graph_text(after)),
            ("fxcoalesce_report", "json", report.to_json),
            ("fxcoalesce_collectives", "string", dot)):
        trace_structured("artifact", metadata_fn=lambda name=name, encoding=encoding: {
            "name": name, "encoding": encoding}, payload_fn=payload)


def graph_text(gm: GraphModule) -> str:
    """The readable code of ``gm``; a comment above each collective a pass made names the
    original collectives it replaces."""
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    notes = {n.name: n.meta[REPLACES] for n in gm.graph.nodes if REPLACES in n.meta}
    if not notes:
        return text
    lines = []
    for line in text.splitlines(keepends=True):
        m = re.match(r"(\s*)(\w+)(?::| =)", line)
        if m and m.group(2) in notes:
            names = notes[m.group(2)]
            lines.append(f"{m.group(1)}# fxcoalesce: replaces {', '.join(names)}\n")
        lines.append(line)
    return "".join(lines)


def dump_directory(directory: str, name: str) -> Path:
    """``directory/<graph>``, or ``directory/rank<R>/<graph>`` when a process group of several
    ranks is up (ranks sharing a directory do not overwrite each other); made if missing."""
    out = Path(directory)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = out / f"rank{dist.get_rank()}"
    out = out / name.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    return out


def dump(directory: str, name: str, before: GraphModule, after: GraphModule,
         report: Report, **extra) -> Path:
    """Write ``before.txt``, ``after.txt`` and ``report.json`` into ``directory/<graph>``
    (``directory/rank<R>/<graph>`` when a process group of several ranks is up, so that
    ranks sharing a directory do not overwrite each other)."""
    out = dump_directory(directory, name)
    (out / "before.txt").write_text(graph_text(before))
    (out / "after.txt").write_text(graph_text(after))
    (out / "report.json").write_text(report.to_json(**extra))
    return out
