"""Which implementations can run an all_reduce, and what each is predicted to leave exposed.

    nccl                _c10d_functional.all_reduce + wait_tensor: NCCL's own stream, so
                        compute between its input and its first consumer hides part of it
    one_shot            symm_mem.one_shot_all_reduce: each rank reads every peer's symmetric
                        buffer over P2P and sums; a kernel on the compute stream (nothing
                        hides it)
    two_shot            symm_mem.two_shot_all_reduce_: reduce-scatter + all-gather over P2P,
                        in place, on the compute stream
    fused_add_rms_norm  fxcoalesce.all_reduce_add_rms_norm: a one-shot sum, the residual add
                        and the RMSNorm after it in one kernel (the ``fuse_norm`` pass)
    nccl_symm           fxcoalesce.nccl_symm_all_reduce: NCCL's all_reduce (its symmetric
                        kernels, NCCL >= 2.27) on a copy in a registered NCCL window; on the
                        compute stream. Only where the process's symmetric-memory backend is
                        NCCL's, which then rules the three above out (``backend_problem``)

Validity reads rank-invariant facts only — the device, the group's backend, op, dtype, world
size, bytes and the calibrated profile — so ranks with one profile choose alike (and a
lowered collective's description names the profile's digest, so ranks with different
profiles see it when they compare). Whether symmetric memory works is tested for real,
collectively, once ranks agreed on a sequence that uses it (``graph_compile``). A profile
without an implementation's curve, or a size past its largest calibrated one, rules that
implementation out; the reason goes into the report. Tests lift the CUDA and NCCL rules for
tensors off CUDA with ``fxcoalesce.testing.reference_lowering`` (``runs_reference``): the ops
then run their references, and descriptions say so.
"""

from __future__ import annotations

import contextlib

import hashlib
import random

import torch

from .collectives import Key
from .config import Config

SYMM_IMPLS = ("one_shot", "two_shot", "nccl_symm")
NCCL_SYMM = "nccl_symm"
FUSED = "fused_add_rms_norm"
SYMM_DTYPES = (torch.bfloat16, torch.float32)
SYMM_WORLDS = (1, 2, 4, 8)
SYMM_OPS = {"one_shot": "symm_mem::one_shot_all_reduce",
            "one_shot_copy": "fxcoalesce::one_shot_all_reduce",
            "two_shot": "symm_mem::two_shot_all_reduce_",
            FUSED: "fxcoalesce::all_reduce_add_rms_norm",
            NCCL_SYMM: "fxcoalesce::nccl_symm_all_reduce"}


def assumed_backend(backend: str | None, cfg: Config) -> str | None:
    """The group's backend; under a fake group (tracing without peers), the backend the
    profile was measured with, so ``inspect`` shows what a real run of that setup would do."""
    if backend == "fake" and cfg.cost.profile is not None:
        return cfg.cost.profile.backend
    return backend


def symm_unusable(key: Key, world: int | None, backend: str | None, cfg: Config) -> str | None:
    """Why no symmetric-memory implementation can run an all_reduce of ``key`` (None: they
    can, as far as rank-invariant facts tell)."""
    from .torch_internals import disabled, reason

    if "symm-mem" in disabled():  # a canary of torch's symm_mem ops failed on this torch
        return reason("symm-mem")
    if cfg.codegen != "inductor":
        return "the eager codegen cannot place inputs in symmetric memory"
    if not key.device.startswith("cuda") and not runs_reference(key):
        return f"tensors on {key.device}: symmetric memory needs CUDA"
    if key.group is None or key.group.startswith("<"):  # collectives.group_identity
        return "a group the graph computes: the symmetric-memory ops take a group's name"
    if backend != "nccl" and not runs_reference(key):
        return f"a {backend or 'unknown'} group: symmetric memory needs an NCCL group"
    if key.op != "sum":
        return f"op {key.op}: the symmetric-memory kernels only sum"
    if key.dtype not in SYMM_DTYPES:
        return f"{str(key.dtype).removeprefix('torch.')}: the kernels take bf16 or fp32"
    if world not in SYMM_WORLDS:
        return f"world size {world}: the kernels run at 1, 2, 4 or 8 ranks"
    return None


def runs_reference(key: Key) -> bool:
    """Whether ``key``'s all_reduce is lowered to reference implementations: tensors off CUDA
    under ``fxcoalesce.testing.reference_lowering`` (test-only)."""
    from .testing import reference_lowering_active

    return reference_lowering_active() and not key.device.startswith("cuda")


def op_available(impl: str) -> str | None:
    """Why this torch cannot run ``impl`` inside a compiled graph (None: it can)."""
    name = SYMM_OPS["one_shot_copy" if impl == "one_shot" and under_cudagraphs() else impl]
    namespace, op = name.split("::")
    if impl in (FUSED, "one_shot", NCCL_SYMM) and (impl != "one_shot" or under_cudagraphs()):
        try:
            import fxcoalesce.kernels  # noqa: F401  (registers the op)
        except ImportError as e:
            return f"fxcoalesce.kernels does not import: {e}"
    packet = getattr(getattr(torch.ops, namespace), op, None)
    if packet is None:
        return f"this torch has no {name}"
    if impl == "two_shot":
        from torch._inductor.lowering import lowerings

        if packet.default not in lowerings:
            return f"Inductor {torch.__version__} has no lowering for {name}"
    return None


CUDAGRAPH_P2P = ("under CUDA graphs, P2P buffers Inductor allocates inside the graph's pool are "
                 "flagged as leaked by CUDA-graph trees (torch 2.11, measured); the one-shot "
                 "runs on a copy in fxcoalesce's workspace instead, the two-shot not at all")


def distinct_p2p_ids(key: str) -> None:
    """Give the P2P buffers Inductor allocates in this compile ids no other graph draws.

    Inductor (torch 2.11-2.13) names each symmetric-memory buffer it allocates with Python's
    ``random`` at code generation (``empty_strided_p2p(..., alloc_id=random.randint(0, 2**64
    - 1))``), and dynamo puts Python's random state back after every compile: each graph
    draws the same ids, so the first call of a second graph whose buffer differs in size
    fails (``empty_strided_p2p_persistent: requested allocation size (131072) is different
    from the size of a previous allocation with the same alloc_id``; measured on one H200,
    torch 2.11, llama-3-8b verify compiled after kimi-k2-tiny's). Seeding from ``key`` (the
    graph's content) gives distinct graphs distinct ids and one graph the same ids on every
    compile; dynamo restores the caller's random state when the compile ends. Outside a
    compile (the pipeline run on its own) no code is generated: nothing is seeded."""
    from torch._guards import TracingContext

    if TracingContext.try_get() is not None:
        random.seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


def backend_problem(impl: str) -> str | None:
    """Why this process's symmetric-memory backend rules ``impl`` out (None: it does not).

    torch's backend is process-wide and fixed at the first symmetric allocation; nccl_symm
    needs NCCL's, the one-shot, two-shot and fused kernels torch's default CUDA one (they
    are not known to work on NCCL windows at several ranks). It is the same on every rank of
    one program, which picks it before compiling (``kernels.nccl_symm.use_nccl_backend``);
    where it is not, the lowered ops' names differ and the ranks' sequences disagree."""
    from fxcoalesce.kernels.nccl_symm import NCCL, process_backend

    backend = process_backend()
    if impl == NCCL_SYMM and backend != NCCL:
        return (f"this process's symmetric-memory backend is {backend or 'not set'}, not NCCL's "
                "(torch fixes "
                "it at the first symmetric allocation: fxcoalesce.kernels.nccl_symm."
                "use_nccl_backend() before any, on every rank)")
    if impl != NCCL_SYMM and backend == NCCL:
        return ("this process's symmetric-memory backend is NCCL's (for nccl_symm); the "
                f"{impl} kernels run on torch's CUDA backend: one backend a process")
    return None


def under_cudagraphs() -> bool:
    """Is this compile for CUDA graphs (``mode="reduce-overhead"``)? The same on every rank."""
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


def exposed_us(impl: str, us: float, window_us: float, cfg: Config,
               nbytes: int | None = None) -> float:
    """What of an all_reduce of ``us`` (``nbytes``) the compute in its window leaves
    exposed: NCCL runs on its own stream; the symmetric-memory kernels run on the compute
    stream."""
    return us - cfg.cost.hidden_us(us, window_us, nbytes) if impl == "nccl" else us


def options(key: Key, nbytes: int, world: int | None, backend: str | None, cfg: Config,
            impls: tuple[str, ...] = ("nccl", *SYMM_IMPLS)
            ) -> tuple[dict[str, float], dict[str, str]]:
    """(implementation -> predicted µs, implementation -> why it is ruled out) for one
    all_reduce of ``key`` and ``nbytes``."""
    backend = assumed_backend(backend, cfg)
    costs, why = {}, {}
    blocked = symm_unusable(key, world, backend, cfg)
    for impl in impls:
        reason = None
        if impl != "nccl":
            reason = (blocked or cfg.cost.impl_missing(impl, nbytes) or op_available(impl)
                      or backend_problem(impl))
            if reason is None and impl == "two_shot" and under_cudagraphs():
                reason = CUDAGRAPH_P2P
            if reason is None and impl == "two_shot" and runs_reference(key):
                reason = "reference lowering: the two-shot has no reference implementation"
        if reason is None:
            costs[impl] = cfg.cost.impl_us(impl, nbytes, world or 2)
        else:
            why[impl] = reason
    return costs, why


def profile_tag(cfg: Config) -> str:
    """What a lowered collective's description says of the profile that chose it."""
    from .testing import reference_lowering_active

    p = cfg.cost.profile
    tag = f"profile {p.digest[:12]}" if p is not None and p.digest else "no profile"
    return tag + ", reference lowering" if reference_lowering_active() else tag


def symm_groups(sequence, ops=None) -> list[str]:
    """The groups on which a collective sequence runs symmetric-memory implementations (of
    ``ops``, op names as in ``SYMM_OPS``'s values: all of them by default)."""
    names = {op.split("::")[1] for op in (SYMM_OPS.values() if ops is None else ops)}
    return sorted({g for g, d in sequence if g is not None and d.split("(")[0] in names})


def symm_problem(sequence, nbytes: int = 0) -> str | None:
    """Test symmetric memory for real on every group ``sequence`` runs it on (a collective
    check, the same on every rank: ranks agreed on ``sequence``) and prepare it for
    all_reduces of up to ``nbytes`` (``kernels.symm.prepare``, or ``kernels.nccl_symm.prepare``
    on a group running nccl_symm: nothing is allocated later, under CUDA graphs); why it
    cannot be used, or None. Only NCCL groups run symmetric memory: others (fake groups while
    tracing, gloo ones under ``testing.reference_lowering``, whose ops run their references)
    are skipped, with no collective."""
    import torch.distributed as dist

    nccl_groups = symm_groups(sequence, [SYMM_OPS[NCCL_SYMM]])
    for name in symm_groups(sequence):
        try:
            if dist.get_backend(_resolve(name)) != "nccl":
                continue
        except Exception:  # a group name nothing here resolves (hand-built graphs)
            continue
        try:
            from fxcoalesce.kernels import nccl_symm, symm
        except ImportError as e:  # every rank runs the same code: all of them land here
            return f"fxcoalesce.kernels does not import: {e}"
        device = torch.device("cuda", torch.cuda.current_device())
        if name in nccl_groups:  # one backend a process (backend_problem): nothing else here
            ok, why = nccl_symm.prepare(name, device, nbytes)
            if not ok:
                return f"group {name}: preparing NCCL's symmetric memory failed: {why}"
            continue
        ok, why = symm.symm_mem_ready(name)
        if not ok:
            return f"group {name}: {why}"
        ok, why = symm.prepare(name, device, nbytes)
        if not ok:
            return f"group {name}: preparing symmetric memory failed: {why}"
    return None


def lowered_bytes(reports) -> int:
    """The largest all_reduce the reports ran on fxcoalesce's workspace: the fused op's, the
    copy-in one-shot's and nccl_symm's (``variant``); Inductor places the others' inputs."""
    return max((d.get("bytes", 0) for r in reports for d in r.decisions
                if d.get("chose") == "fused" or "variant" in d), default=0)


def _resolve(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@contextlib.contextmanager
def real_tensors():
    """Real tensors even inside a compile's fake mode (symmetric memory is allocated here)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        yield
