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

from . import checked
from .analysis import analysis_cache, analyze, graph_state, remapped, remember, same_state
from .config import Config
from .cost import Roofline, carry_estimates, compute_prefix, graph_device
from .collectives import group_setup, is_collective
from .meta import ORIGIN, REPLACES, fast_graph_copy, is_torch_file, user_frame
from .report import Report, build_report, collective_modules, record

log = logging.getLogger("fxcoalesce")
_graph_ids = itertools.count()


def next_graph_name() -> str:
    """A process-unique name for the next compiled graph ("graph 0", "graph 1", ...)."""
    return f"graph {next(_graph_ids)}"


def copy_graph_module(gm: GraphModule, nodes: dict | None = None) -> GraphModule:
    """A new GraphModule over a node-for-node copy of ``gm.graph`` (meta shared shallowly).
    ``nodes``, if given, is filled with each original node's copy (the output's included).

    Lazy: its Python code is generated only if someone reads or runs it (Inductor lowers
    the graph itself), which on a 10k-node graph saves most of the pipeline's time.
    """
    graph = Graph()
    nodes = {} if nodes is None else nodes
    if _FAST_COPY and _fast_copy_on():
        out = fast_graph_copy(gm.graph, graph, nodes)
    else:
        out = graph.graph_copy(gm.graph, nodes)
    # Inductor keeps facts on the output node (user-visible outputs and their strides)
    old_output = gm.graph.output_node()
    new_output = graph.output(out)
    new_output.meta = copy.copy(old_output.meta)
    nodes[old_output] = new_output
    with _use_lazy_graph_module(True):
        return _make_graph_module(gm, graph)


def _fast_copy_on() -> bool:
    from .torch_internals import enabled

    return enabled("fast-graph-copy")


_FAST_COPY = all(hasattr(Graph(), a) for a in ("_graph_namespace", "_insert",
                                                 "_find_nodes_lookup_table", "_len"))


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
    with _gc_paused(), analysis_cache():
        return _run_pipeline(gm, cfg, name=name, record_report=record, emit=emit)


def rank_configs(cfg: Config) -> tuple[Config, Config]:
    """(``cfg`` without the choices that read compute, ``cfg`` in the program's own collective
    order): the rank layer's fallbacks, from the passes' registry (``ranks`` reaches the
    passes only through this module)."""
    from fxcoalesce.passes import program_order, without_compute_choices

    return without_compute_choices(cfg), program_order(cfg)


def changes_sequence(cfg: Config) -> bool:
    """Can the pipeline of ``cfg`` issue another collective sequence than the program's?"""
    from fxcoalesce.passes import changes_sequence as changes

    return changes(cfg)


def emitter(graph: Graph, **where):
    """The passes' node emitter (``passes.emit.Emitter``), for the rank layer's tags."""
    from fxcoalesce.passes.emit import Emitter

    return Emitter(graph, **where)


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
    # the compute estimates of the report's prediction, made now to be carried to the copy
    compute_prefix(before, Roofline.of(cfg.cost, graph_device(before)))
    copies: dict = {}
    work = copy_graph_module(gm, copies)
    carry_estimates(copies)
    remember(work.graph, remapped(before, copies))  # the first pass's analysis, read across
    del copies
    modules = collective_modules(before) if cfg.dump_dir and cfg.dump_passes else {}
    for i, n in enumerate(n for n in work.graph.nodes if is_collective(n)):
        n.meta[ORIGIN] = f"#{i}"  # the program's own place: what ranks compare (meta.ORIGIN)
    timings, buckets, decisions, warnings = [], [], [], []
    fell_back, pass_name = False, None
    linted: list = []  # the graph's state when it last passed lint
    try:
        for pass_name in cfg.enabled_passes:
            result = _run_pass(pass_name, PASSES[pass_name], work, cfg, name, timings, modules,
                               linted)
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
              timings: list[dict], modules: dict[str, str], linted: list):
    """One pass, the way every pass runs: timed, the graph linted after it (a pass that
    breaks the graph is named, not the one after it; a graph left as it was when it last
    passed lint, ``linted``, is not linted again), and with ``cfg.dump_passes`` its graph
    written as ``after_<pass>.txt`` beside the graph's dump (``modules``: the module path of
    each original collective, for the notes)."""
    t = time.perf_counter()
    # what stays as the program has it (the run-time check's place), handed to the pass: a
    # pass may move such an all_reduce past what keeps its size (linearity), so it is read
    # off the graph as it is now
    pinned = checked.pinned(list(analyze(work).scan.sequence), cfg.run_checks)
    result = fn(work, cfg=cfg, pinned=pinned)
    state = graph_state(work.graph)
    if not (linted and same_state(linted[0], state)):
        work.graph.lint()
        linted[:] = [state]
    timings.append({"name": pass_name, "ms": round((time.perf_counter() - t) * 1e3, 3),
                    "changed": result.changed})
    if cfg.dump_dir and cfg.dump_passes and result.changed:
        work.recompile()
        out = dump_directory(cfg.dump_dir, graph_name)
        (out / f"after_{pass_name}.txt").write_text(graph_text(work, modules))
    return result


def trace_artifacts(before: GraphModule, after: GraphModule, report: Report) -> None:
    """The graphs, the report and the collective picture as structured-trace artifacts, so
    ``TORCH_TRACE=dir`` + ``tlparse`` show them next to Inductor's own. Costs a few calls
    when tracing is off: ``trace_structured`` calls no ``payload_fn`` then."""
    from .viz.picture import graph_dot

    dot = lambda: graph_dot(before, after, title=report.graph,  # noqa: E731
                            bound=report.all_reduce["lower_bound"])
    for name, encoding, payload in (
            ("fxcoalesce_before", "string", lambda: graph_text(before, report.modules)),
            ("fxcoalesce_after", "string", lambda: graph_text(after, report.modules)),
            ("fxcoalesce_report", "json", report.to_json),
            ("fxcoalesce_collectives", "string", dot)):
        trace_structured("artifact", metadata_fn=lambda name=name, encoding=encoding: {
            "name": name, "encoding": encoding}, payload_fn=payload)


_LOCATION = re.compile(r"(\s*#.*?)File: (.+?):(\d+) in (.+?), code: (.*)")
"""A location comment of ``print_readable``: "# File: path:line in function, code: text"."""
_NODE_LINE = re.compile(r"(\s*)(\w+)(?::| =)")


def graph_text(gm: GraphModule, modules: dict[str, str] | None = None) -> str:
    """The readable code of ``gm``, its location comments pointing at the user's code: one
    that names a file of PyTorch (``_functional_collectives.py``, where every collective is
    made) names the innermost frame outside PyTorch of the next node's stack trace instead.
    A comment above each collective a pass made names the original collectives it replaces,
    with their module paths from ``modules`` (FX name -> path; ``Report.modules``)."""
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    nodes = {n.name: n for n in gm.graph.nodes}
    notes = {n.name: n.meta[REPLACES] for n in gm.graph.nodes if REPLACES in n.meta}
    modules = modules or {}
    lines = text.splitlines(keepends=True)
    out, location = [], None
    for i, line in enumerate(lines):
        if loc := _LOCATION.match(line):
            if is_torch_file(loc.group(2)):
                line = _user_location(loc.group(1), lines, i + 1, nodes) or line
            if line == location:  # the same as the comment above: it still holds here
                if out and not out[-1].strip():
                    out.pop()
                continue
            location = line
        m = _NODE_LINE.match(line)
        if m and m.group(2) in notes:
            names = [f"{n} ({modules[n]})" if modules.get(n) else n for n in notes[m.group(2)]]
            out.append(f"{m.group(1)}# fxcoalesce: replaces {', '.join(names)}\n")
        out.append(line)
    return "".join(out)


def _user_location(prefix: str, lines: list[str], start: int, nodes: dict) -> str | None:
    """The location comment of the first node line from ``lines[start]`` on, from the
    innermost frame of its stack trace outside PyTorch; None when it has none."""
    for j in range(start, len(lines)):
        m = _NODE_LINE.match(lines[j])
        if m and m.group(2) in nodes:
            frame = user_frame(nodes[m.group(2)].stack_trace)
            if frame is None:
                return None
            file, lineno, function, code = frame
            return f"{prefix}File: {file}:{lineno} in {function}, code: {code}\n"
    return None


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
    """Write ``before.txt``, ``after.txt``, ``report.json`` and the collectives picture
    (``collectives.dot``, and ``collectives.png`` when Graphviz or matplotlib is here) into
    ``directory/<graph>`` (``directory/rank<R>/<graph>`` when a process group of several
    ranks is up, so that ranks sharing a directory do not overwrite each other)."""
    out = dump_directory(directory, name)
    (out / "before.txt").write_text(graph_text(before, report.modules))
    (out / "after.txt").write_text(graph_text(after, report.modules))
    (out / "report.json").write_text(report.to_json(**extra))
    dump_picture(out, before, after, report)
    return out


def dump_picture(out: Path, before: GraphModule, after: GraphModule, report: Report) -> None:
    """``out/collectives.dot``, and ``out/collectives.png`` drawn by Graphviz's ``dot`` or
    matplotlib when either is here (a drawing that fails is a warning: the dump is a
    debugging aid, never a reason for a compile to fail)."""
    from .viz.draw import render_picture, renderer
    from .viz.picture import graph_panels, to_dot

    panels = graph_panels(before, after, bound=report.all_reduce["lower_bound"])
    (out / "collectives.dot").write_text(to_dot(panels, report.graph))
    if renderer() is None:
        return
    try:
        render_picture(panels, out / "collectives.png", "png", title=report.graph)
    except Exception as e:  # noqa: BLE001 - any drawing failure
        log.warning("fxcoalesce[%s]: collectives.png not drawn: %s: %s", report.graph,
                    type(e).__name__, e)
