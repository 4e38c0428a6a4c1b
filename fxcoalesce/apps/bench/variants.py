"""The ways ``fxcoalesce bench`` runs one step, and how each is made.

    eager                the model's own code, no compile
    inductor             torch.compile (Inductor) as it comes: since torch 2.14 that includes
                         ``simple_overlap`` (collectives issued early, waits late, in order)
    inductor-no-overlap  Inductor with ``simple_overlap`` off (torch 2.14+)
    inductor-bucketing   Inductor with its own all_reduce bucketing (``bucket_all_reduces_fx``)
                         and the overlap options it had before 2.14 (:func:`bucketing_options`)
    inductor-overlap     Inductor's overlap scheduler with collective bucketing, analytical
                         estimators (the same on every rank, and they run on CPU): torch 2.13+
                         with Triton installed (a CUDA build of torch, also on a CPU)
    inductor-reorder     Inductor's comm reordering passes ``sink_waits``, ``raise_comms``,
                         ``reorder_compute_for_overlap`` (torch 2.14+: before, they mis-ordered
                         KV-cache writes)
    inductor-one-shot    Inductor with ``_collective.auto_select`` and symmetric memory enabled
                         for the group: PyTorch's own one-shot lowering (all_reduces up to
                         128 KiB; CUDA + NCCL only)
    hand-merged          the engines' hand-merged model code under plain torch.compile
    fxcoalesce           torch.compile through fxcoalesce.backend(): since torch 2.14 Inductor's
                         comm reordering passes run after it (``compiler.backend``)
    fxcoalesce-no-reorder  fxcoalesce without them (torch 2.14+)
    fxcoalesce-split     fxcoalesce with the token split forced on (``Config(token_split=True)``)
    fxcoalesce-no-split  fxcoalesce with it off (``Config(token_split=False)``)
    no-comm              Inductor with every all_reduce replaced by a local scale (x * world
                         size): WRONG RESULTS BY DESIGN, the floor (what the step costs if
                         communication were free); never a default, never a reference

Every compiled variant calls the step through a function whose code object is its own
(:func:`own_code`): dynamo keeps compiled code on code objects, and two variants of one model
would otherwise share it (DESIGN.md: "two instances of one model class compiled one after
the other share dynamo's compiled code"). The variants whose difference is an Inductor
setting also keep Inductor's caches from serving one's graph to another: no-comm's pass has
a uuid of its own (it is in the cache key), inductor-one-shot compiles with the FX graph
cache off (torch 2.11 may leave private settings such as ``_collective.auto_select`` out of
the key). Torch is imported where needed: the CLI checks variant names before importing it.
"""

from __future__ import annotations

import copy
import dataclasses

VARIANTS = ("eager", "inductor", "inductor-no-overlap", "inductor-bucketing", "inductor-overlap",
            "inductor-reorder", "inductor-one-shot", "hand-merged", "fxcoalesce",
            "fxcoalesce-no-reorder", "fxcoalesce-split", "fxcoalesce-no-split", "no-comm")
DEFAULT_VARIANTS = tuple(v for v in VARIANTS
                         if v not in ("no-comm", "fxcoalesce-split", "fxcoalesce-no-split"))
WRONG_BY_DESIGN = ("no-comm",)
"""Variants whose results are wrong on purpose: flagged in every output, never a reference."""
FLOOR = "no-comm"
"""The variant every other's ``exposed_comm_ms`` is measured from."""
SCHED = "aten_distributed_optimizations."
SIMPLE_OVERLAP = f"{SCHED}enable_simple_overlap"


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


def has_triton() -> bool:
    """Whether Triton imports here (the CUDA builds of torch bring it; the CPU wheel does not)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def option_tiers(name: str, device: str, cudagraphs: bool) -> list[dict] | str:
    """The Inductor options of variant ``name``, best first (a tier that fails to compile
    gives way to the next), or why this torch cannot run it; ``[None]`` for variants that
    set no Inductor option of their own."""
    import torch

    from fxcoalesce.torch_internals import comm_reorder_options

    known = set(torch._inductor.list_options())
    base = {"triton.cudagraphs": True} if cudagraphs else {}
    version = torch.__version__
    if name == "inductor-bucketing":
        return bucketing_options(device, cudagraphs) or f"torch {version} has no " \
            "bucket_all_reduces_fx"
    if name == "inductor-no-overlap":
        if SIMPLE_OVERLAP not in known:
            return f"torch {version} has no simple_overlap: plain inductor runs without it"
        return [{**base, SIMPLE_OVERLAP: False}]
    if name == "inductor-overlap":
        overlap = {f"{SCHED}enable_overlap_scheduling": True,
                   f"{SCHED}collective_bucketing": True,
                   f"{SCHED}collective_estimator": "analytical",
                   f"{SCHED}compute_estimator": "analytical"}
        if not set(overlap) <= known:
            return f"torch {version} has no overlap scheduler with collective bucketing"
        if not has_triton():
            return "Inductor's overlap scheduler needs Triton, which this torch install lacks"
        return [{**base, **overlap}]
    if name in ("inductor-reorder", "fxcoalesce-no-reorder"):
        reorder = comm_reorder_options()
        if not reorder:
            return (f"torch {version}: Inductor's raise_comms / sink_waits mis-order KV-cache "
                    "writes before 2.14 (tests/test_ranks.py)")
        if name == "fxcoalesce-no-reorder":
            return [{**base, "reorder_for_compute_comm_overlap": False}]
        return [{**base, **reorder}]
    return [None]


def unavailable(name: str, device: str, backend: str) -> str | None:
    """Why variant ``name`` cannot run on this setup (a skip note), None when it can."""
    if name != "inductor-one-shot":
        return None
    import torch

    if device != "cuda" or backend != "nccl":
        return (f"PyTorch's one-shot lowering needs symmetric memory: CUDA ranks of an NCCL "
                f"group, not {backend} on {device}")
    if "_collective.auto_select" not in torch._inductor.config.get_config_copy():
        return f"torch {torch.__version__} has no _collective.auto_select"
    return None


def one_shot_options(cudagraphs: bool) -> dict:
    """Inductor options of ``inductor-one-shot``: auto_select, no FX graph cache (nor, with
    it, AOTAutograd's), CUDA graphs as ``mode="reduce-overhead"`` sets them."""
    options = {"_collective.auto_select": True, "fx_graph_cache": False}
    if cudagraphs:
        options["triton.cudagraphs"] = True
    return options


class NoComm:
    """An Inductor ``post_grad_custom_pre_pass``: ``wait_tensor(all_reduce(x, op, group))``
    becomes ``x * world`` (sum; ``x`` for avg, max, min), so the step runs its compute with
    no all_reduce at all. Other collectives (the output head's all_gather) stay."""

    def __init__(self, world: int):
        self.world = world

    def __call__(self, graph) -> None:
        import torch

        from fxcoalesce.reduce_ops import reduce_op_name

        c10d = torch.ops._c10d_functional
        for ar in [n for n in graph.nodes if n.op == "call_function"
                   and n.target is c10d.all_reduce.default]:
            x, op = ar.args[0], ar.args[1]
            with graph.inserting_after(ar):
                local = (graph.call_function(torch.ops.aten.mul.Tensor, (x, self.world))
                         if reduce_op_name(op) == "sum" else x)
            if local is not x:
                local.meta.update(ar.meta)
            for user in list(ar.users):
                if user.op == "call_function" and user.target is c10d.wait_tensor.default:
                    user.replace_all_uses_with(local)
                    graph.erase_node(user)
            ar.replace_all_uses_with(local)
            graph.erase_node(ar)

    def uuid(self) -> str:
        import hashlib
        import inspect

        return hashlib.sha256(f"{inspect.getsource(NoComm)}{self.world}".encode()).hexdigest()


def no_comm_options(world: int, cudagraphs: bool) -> dict:
    options = {"post_grad_custom_pre_pass": _custom_pass(NoComm(world))}
    if cudagraphs:
        options["triton.cudagraphs"] = True
    return options


def _custom_pass(p: NoComm):
    """``p`` as Inductor's ``CustomGraphPass`` (its ``uuid()`` goes into the cache key)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph) -> None:
            p(graph)

        def uuid(self) -> str:
            return p.uuid()

    return _Pass()


def compile_variant(name: str, fn, label: str, *, cudagraphs: bool,
                    options: dict | None = None, on_graph=None, world: int = 1):
    """The callable of compiled variant ``name`` for step ``fn`` (eager returns ``fn``).
    ``options`` are the variant's (:func:`option_tiers`); ``on_graph`` receives fxcoalesce's reports;
    ``world`` is no-comm's scale."""
    import torch

    if name == "eager":
        return fn
    step = own_code(fn, label)
    mode = "reduce-overhead" if cudagraphs else None
    common = {"fullgraph": True, "dynamic": False}
    if name in ("inductor", "hand-merged"):
        return torch.compile(step, mode=mode, **common)
    if name in ("inductor-no-overlap", "inductor-bucketing", "inductor-overlap",
                "inductor-reorder"):
        return torch.compile(step, options=options, **common)
    if name == "inductor-one-shot":
        return torch.compile(step, options=one_shot_options(cudagraphs), **common)
    if name == "no-comm":
        return torch.compile(step, options=no_comm_options(world, cudagraphs), **common)
    if name in ("fxcoalesce", "fxcoalesce-no-reorder"):
        from fxcoalesce.compiler import backend

        # with options (fxcoalesce-no-reorder) CUDA graphs come as triton.cudagraphs, not a mode
        be = backend(on_graph=on_graph, mode=None if options else mode, options=options)
        return torch.compile(step, backend=be, **common)
    if name in ("fxcoalesce-split", "fxcoalesce-no-split"):
        from fxcoalesce.compiler import backend
        from fxcoalesce.config import Config

        cfg = Config(token_split=name == "fxcoalesce-split")
        return torch.compile(step, backend=backend(cfg, on_graph=on_graph, mode=mode), **common)
    raise ValueError(f"unknown variant {name!r}; choose from: {', '.join(VARIANTS)}")
