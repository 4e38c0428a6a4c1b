"""Trace a named model's step under fake tensors and a fake process group (no weights, no
GPU) and run the pipeline on it: what ``fxcoalesce inspect`` shows."""

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
    n_layers = models.args_of(name, layers).n_layers  # unknown names fail here, before work
    say = say or (lambda text: None)
    say(f"tracing {name}{' (hand-merged)' if hand_merged else ''} {step} at TP {tp} "
        f"({n_layers} layers, {tokens} tokens) under fake tensors: Dynamo, AOTAutograd and "
        "the pipeline ...")
    t0 = time.perf_counter()
    group = init_fake_group(tp) if tp > 1 else None
    mode = FakeTensorMode()
    with mode:
        model = models.build(name, hand_merged=hand_merged, dtype=dtype, layers=layers)
        models.apply_tp(model, group)
        fn, args = make_step(model, step, tokens)
    graphs = []
    cfg = replace(config or Config(), codegen="eager")
    compiled = torch.compile(fn, backend=backend(cfg, on_graph=lambda *g: graphs.append(g)),
                             fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad(), mode:
        compiled(*args)
    before, after, report = graphs[0]
    seconds = time.perf_counter() - t0
    say(f"  traced in {seconds:.1f} s")
    return Traced(before, after, report, seconds)
