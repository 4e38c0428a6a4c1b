"""Trace a model's step under fake tensors and a fake process group (no weights, no GPU) and
run the pipeline on it: what ``fxcoalesce inspect`` shows.

    traced = trace_model("kimi-k2", tp=8, tokens=3, step="verify")     # the zoo
    traced = trace_step(fn, args, mode)     # any step built under ``mode`` (apps.inspect)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule

from fxcoalesce.compiler import backend
from fxcoalesce.config import Config
from fxcoalesce.report import Report

from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.apps.steps import make_step


@dataclass(slots=True)
class Traced:
    """The graph before and after the pipeline, its report, and how long tracing took."""

    before: GraphModule
    after: GraphModule
    report: Report
    seconds: float


def trace_step(fn: Callable, args: tuple, mode: FakeTensorMode, *,
               config: Config | None = None) -> tuple[GraphModule, GraphModule, Report]:
    """Compile ``fn`` (one graph: ``fullgraph=True``) with the fxcoalesce backend, run it on
    ``args`` under ``mode`` (the fake mode its parameters were made in) and return the first
    graph the backend saw: before the pipeline, after it, and its report. The rewritten graph
    runs as Python (``codegen="eager"``) on fake tensors: nothing is computed."""
    graphs = []
    cfg = replace(config or Config(), codegen="eager")
    compiled = torch.compile(fn, backend=backend(cfg, on_graph=lambda *g: graphs.append(g)),
                             fullgraph=True)
    torch._dynamo.reset()  # a new model: never a cached graph of an earlier one
    with torch.no_grad(), mode:
        compiled(*args)
    return graphs[0]


def trace_model(name: str, *, tp: int, tokens: int, step: str = "forward",
                hand_merged: bool = False, config: Config | None = None,
                layers: int | None = None,
                dtype: torch.dtype = torch.bfloat16,
                say: Callable[[str], None] | None = None) -> Traced:
    """Build ``name`` under ``FakeTensorMode``, shard it over a fake group of ``tp`` ranks,
    compile ``step`` with the fxcoalesce backend and return the first graph it rewrote.
    ``say`` (if given) is told what is traced before, and how long it took after: a large
    model takes a minute."""
    from fxcoalesce import models

    if tp < 1 or tokens < 1:
        raise ValueError("--tp and --tokens must be at least 1")
    from fxcoalesce.apps.progress import Phase

    n_layers = models.args_of(name, layers).n_layers  # unknown names fail here, before work
    t0 = time.perf_counter()
    if say:
        say(f"tracing {name}{' (hand-merged)' if hand_merged else ''} {step} at TP {tp} "
            f"({n_layers} layers, {tokens} tokens) under fake tensors: Dynamo, AOTAutograd "
            "and the pipeline ...")
    with Phase(say, "tracing", announce=False, done="traced"):
        group = init_fake_group(tp) if tp > 1 else None
        mode = FakeTensorMode()
        with mode:
            model = models.build(name, hand_merged=hand_merged, dtype=dtype, layers=layers)
            models.apply_tp(model, group)
            fn, args = make_step(model, step, tokens)
        before, after, report = trace_step(fn, args, mode, config=config)
    return Traced(before, after, report, time.perf_counter() - t0)
