"""The ways ``fxcoalesce bench`` runs one step, and how each is made.

    eager               the model's own code, no compile
    inductor            torch.compile (Inductor), nothing else
    inductor-bucketing  Inductor with its own all_reduce bucketing and overlap options
    hand-merged         the engines' hand-merged model code under plain torch.compile
    fxcoalesce          torch.compile through fxcoalesce.backend()

Every compiled variant calls the step through a function whose code object is its own
(:func:`own_code`): dynamo keeps compiled code on code objects, and two variants of one model
would otherwise share it (DESIGN.md: "two instances of one model class compiled one after
the other share dynamo's compiled code"). Torch is imported where needed: the CLI checks
variant names before importing it.
"""

from __future__ import annotations

import copy
import dataclasses

VARIANTS = ("eager", "inductor", "inductor-bucketing", "hand-merged", "fxcoalesce")


def parse_variants(text: str) -> tuple[str, ...]:
    """'eager,fxcoalesce' -> ('eager', 'fxcoalesce') in the order given; unknown names raise."""
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--variants: unknown variant(s) {', '.join(map(repr, unknown))}; "
                         f"choose from: {', '.join(VARIANTS)}" if unknown else
                         f"--variants names none; choose from: {', '.join(VARIANTS)}")
    return names


def has_hand_merged(name: str) -> bool:
    """Whether model ``name`` has hand-merged code: parallel-block dense models (one
    all_reduce per block) and the DeepSeek family (routed + shared experts summed first)."""
    from fxcoalesce import models

    try:
        dataclasses.replace(models.args_of(name), hand_merged=True)
    except (ValueError, TypeError):  # sequential blocks (Llama's config has no such field)
        return False
    return True


def hand_merged_twin(model):
    """A copy of ``model`` running its hand-merged code on the same parameters and buffers
    (no extra weight memory): what ``models.build(name, hand_merged=True)`` builds, with the
    same seeded weights. The families read the flag from ``module.args.hand_merged``
    (dense blocks) or ``module.hand_merged`` (MoE)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    shared.update({id(m.group): m.group for m in model.modules()
                   if getattr(m, "group", None) is not None})  # process groups stay shared
    twin = copy.deepcopy(model, shared)
    for m in twin.modules():
        args = getattr(m, "args", None)
        if dataclasses.is_dataclass(args) and hasattr(args, "hand_merged"):
            m.args = dataclasses.replace(args, hand_merged=True)
        if hasattr(m, "hand_merged"):
            m.hand_merged = True
    return twin


def own_code(fn, label: str):
    """``fn`` behind a function with a code object of its own (named ``label``), so dynamo's
    cache for one variant never serves another."""
    namespace = {"fn": fn}
    exec(compile("def step(*args):\n    return fn(*args)\n", f"<{label}>", "exec"), namespace)
    return namespace["step"]


def bucketing_options(device: str, cudagraphs: bool) -> list[dict]:
    """Inductor options for ``inductor-bucketing``, best first; those this torch lacks are
    dropped. Every tier buckets all_reduces (``bucket_all_reduces_fx="all"``); the overlap
    part differs: on CUDA, Inductor's overlap scheduler with analytical (rank-invariant)
    estimates; else, or if that fails to compile, the scheduler passes fxcoalesce's backend
    also turns on (``sink_waits``, ``raise_comms``); last, bucketing alone. The overlap
    scheduler needs Triton, so it is not offered on CPU. Empty when this torch has no
    ``bucket_all_reduces_fx``."""
    import torch

    known = set(torch._inductor.list_options())
    if "bucket_all_reduces_fx" not in known:
        return []
    base = {"bucket_all_reduces_fx": "all"}
    if cudagraphs:
        base["triton.cudagraphs"] = True
    sched = "aten_distributed_optimizations."
    overlap = {f"{sched}enable_overlap_scheduling": True,
               f"{sched}collective_estimator": "analytical",
               f"{sched}compute_estimator": "analytical"}
    tiers = []
    # only where every rank's estimate is sure to be the same (no benchmarking on the rank)
    if device == "cuda" and set(overlap) <= known:
        tiers.append({**base, **overlap})
    tiers.append({**base, "reorder_for_compute_comm_overlap": True,
                  "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms"]})
    tiers.append(base)
    return [{k: v for k, v in t.items() if k in known} for t in tiers]


def compile_variant(name: str, fn, label: str, *, cudagraphs: bool,
                    options: dict | None = None, on_graph=None):
    """The callable of compiled variant ``name`` for step ``fn`` (eager returns ``fn``).
    ``options`` are inductor-bucketing's; ``on_graph`` receives fxcoalesce's reports."""
    import torch

    if name == "eager":
        return fn
    step = own_code(fn, label)
    mode = "reduce-overhead" if cudagraphs else None
    common = {"fullgraph": True, "dynamic": False}
    if name in ("inductor", "hand-merged"):
        return torch.compile(step, mode=mode, **common)
    if name == "inductor-bucketing":
        return torch.compile(step, options=options, **common)
    if name == "fxcoalesce":
        from fxcoalesce.compiler import backend

        return torch.compile(step, backend=backend(on_graph=on_graph, mode=mode), **common)
    raise ValueError(f"unknown variant {name!r}; choose from: {', '.join(VARIANTS)}")
