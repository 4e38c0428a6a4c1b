"""What ``notebooks/walkthrough.ipynb`` runs on real ranks.

``apps.launch.spawn`` starts fresh processes that import their worker by module and name, so
a function defined in a notebook cell (module ``__main__`` of the kernel) cannot be one: the
worker lives here.

    results = spawn(compare_worker, 2, ("neox-tiny", 8), backend="gloo")
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxcoalesce.compiler import backend
from fxcoalesce.config import Config


def compare_worker(rank: int, world: int, name: str = "neox-tiny", tokens: int = 8,
                   codegen: str = "eager") -> dict:
    """One rank: build ``name`` (same seed on every rank), shard it over the ranks, run it
    eagerly and compiled through fxcoalesce on the same tokens; return both logits, their
    largest difference and the report's all_reduce counts.

    ``codegen="eager"`` runs the rewritten graph as Python: the same collectives as with
    Inductor, in seconds instead of a minute of C++ compilation on a small CPU machine.
    """
    from fxcoalesce import models

    torch.set_num_threads(1)
    model = models.apply_tp(models.build(name), dist.group.WORLD)
    ids = torch.randint(0, model.args.vocab, (1, tokens),
                        generator=torch.Generator().manual_seed(0))
    reports = []
    compiled = torch.compile(model, fullgraph=True, backend=backend(
        Config(codegen=codegen), on_graph=lambda before, after, report: reports.append(report)))
    with torch.no_grad():
        eager, fused = model(ids), compiled(ids)
    return {"rank": rank, "eager": eager, "fxcoalesce": fused,
            "max_abs_diff": float((eager - fused).abs().max()),
            "all_reduce": reports[0].all_reduce}
