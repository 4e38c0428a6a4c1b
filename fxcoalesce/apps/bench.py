"""Side-by-side step latency of a model compiled with and without the fxcoalesce pass,
on real ranks (gloo on CPU or host-staged CUDA, NCCL with one GPU per rank).

Both variants run in the same processes, interleaved step by step after a warm-up, and
their outputs are compared; latencies are medians (CUDA events on GPU).
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from fxcoalesce.compiler import backend
from fxcoalesce.config import Config

from fxcoalesce.report import reports

from .steps import make_step
from .timing import timed


def bench_worker(rank: int, world: int, name: str, tokens: int, steps: int, warmup: int,
                 codegen: str, hand_merged: bool = False, device: str = "cpu") -> dict:
    """One rank's part of :func:`fxcoalesce.cli` ``bench``; returns latencies in µs."""
    from fxcoalesce import models

    dev = torch.device(f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
                       if device == "cuda" else "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    def step():  # one model per variant: same seed, so the same weights
        model = models.apply_tp(models.build(name, hand_merged=hand_merged, device=dev),
                                dist.group.WORLD)
        return model, *make_step(model, "forward", tokens)

    model, fn_without, args = step()
    _, fn_with, _ = step()
    torch.manual_seed(1)
    args = (torch.randint(0, model.args.vocab, args[0].shape, device=dev),
            *(a.to(dev) for a in args[1:]))
    base = "inductor" if codegen == "inductor" else backend(
        Config(codegen="eager", passes=()))
    variants = {
        "without pass": torch.compile(fn_without, backend=base, fullgraph=True),
        "with pass": torch.compile(fn_with, backend=backend(Config(codegen=codegen)),
                                   fullgraph=True),
    }
    times = {k: [] for k in variants}
    outs = {}
    with torch.no_grad():
        for i in range(warmup + steps):
            for k, f in variants.items():
                dist.barrier()
                outs[k], us = timed(lambda: f(*args), dev)
                if i >= warmup:
                    times[k].append(us)
    a, b = outs.values()
    report = reports()[-1]
    return {
        "rank": rank, "world_size": world, "model": name, "tokens": tokens, "codegen": codegen,
        "backend": dist.get_backend(), "device": str(dev), "steps": steps, "warmup": warmup,
        "median_us": {k: statistics.median(v) for k, v in times.items()},
        "p10_us": {k: sorted(v)[len(v) // 10] for k, v in times.items()},
        "p90_us": {k: sorted(v)[(len(v) * 9) // 10] for k, v in times.items()},
        "identical": bool(torch.equal(a, b)),
        "max_abs_diff": float((a.float() - b.float()).abs().max()),
        "all_reduce": report.all_reduce,
    }
