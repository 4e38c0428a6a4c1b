"""Symmetric memory for the fused kernels: one workspace per (group, device), and a readiness
check that every rank of a group answers alike.

    ok, why = symm_mem_ready(group_name)        # collective on first call, then cached
    ws = get_workspace(group_name, device, nbytes)   # collective when it (re)allocates

Rank safety. Both calls are collectives whenever they do real work (a rendezvous, a vote), so
they must be reached by every rank of the group in the same order, which holds when the ranks
agreed on their collective sequences (fxcoalesce's compile-time agreement) and decide from
rank-invariant facts only: the group, and the sizes and dtypes the ops are called with.
Nothing here reads per-rank state (free memory, timings, the driver's P2P answer) to decide.

Multicast is never used: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set (``setdefault``) at
import and before every allocation, because NVLink multicast can take a shared host's GPUs
down, and torch reads it when it first allocates symmetric memory (which may be Inductor's
allocation, not ours: hence the import).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def _safe_env() -> None:
    os.environ.setdefault(MULTICAST_ENV, "1")


_safe_env()

BARRIER_TIMEOUT_MS = 30_000
"""A peer that never reaches the readiness check's barrier traps its kernel after this long
(a loud CUDA error and a watchdog abort, rather than a silent hang)."""

MIN_WORKSPACE_BYTES = 1 << 20
"""Smallest workspace: every decode shape up to 64 x 8192 x bf16 fits in 1 MiB, so the
common case allocates once."""


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA, where
    torch's own query raises)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def resolve_group(group_name: str) -> dist.ProcessGroup | None:
    """The process group named ``group_name``, or None when this process has none."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except Exception:  # unknown name: torch raises ValueError or RuntimeError by version
        return None


def group_size(group_name: str) -> int:
    """World size of the named group; 1 when there is no such group (no peers)."""
    pg = resolve_group(group_name)
    return 1 if pg is None else pg.size()


def _enable(group_name: str) -> None:
    """``enable_symm_mem_for_group``: still what Inductor's ``is_symm_mem_enabled_for_group``
    checks in 2.11-2.13, and deprecated (a FutureWarning) in 2.13."""
    from torch.distributed import _symmetric_memory as symm

    if not symm.is_symm_mem_enabled_for_group(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group_name)


def _precheck(group_name: str) -> str | None:
    """Why symmetric memory cannot be used, from facts every rank of the group shares (its
    backend, CUDA's presence), or None when the real test has to decide."""
    pg = resolve_group(group_name)
    if pg is None:
        return f"no process group named {group_name!r} in this process"
    backend = str(dist.get_backend(pg))
    if backend == "fake":
        return "fake process group (tracing only): no devices, no peers"
    if "nccl" not in backend:
        return f"backend {backend!r}: symmetric memory needs CUDA ranks of an NCCL group"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def _vote(pg: dist.ProcessGroup, step: str, error: str | None) -> str | None:
    """Agree on one step: None when it passed on every rank, else the first failing rank's
    reason, the same on every rank. An all_reduce MIN over the group's own backend (the
    tensor on the device that backend reduces), then, only after a failure, an
    all_gather_object for the reasons: both branches are taken by every rank alike."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(
        dist.get_backend(pg)) else torch.device("cpu")
    flag = torch.tensor([0 if error else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
    if int(flag.item()) == 1:
        return None
    reasons: list[str | None] = [None] * pg.size()
    dist.all_gather_object(reasons, error, group=pg)
    rank, why = next((r, w) for r, w in enumerate(reasons) if w)
    return f"{step}: rank {rank} of the group: {why}"


def run_agreed_steps(pg: dist.ProcessGroup, steps: list[tuple[str, Callable[[], None]]]
                     ) -> tuple[bool, str]:
    """Run ``steps`` (name, fn) in order on every rank, voting after each: a step that raises
    on any rank stops all ranks before the next step (which may be a collective the failed
    rank would never join). Exceptions are caught locally, never propagated."""
    for name, fn in steps:
        try:
            fn()
            error = None
        except Exception as e:  # the reason travels to every rank
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        failed = _vote(pg, name, error)
        if failed:
            return False, failed
    return True, "ok"


_READY: dict[str, tuple[bool, str]] = {}
_PROBES: list = []  # the test buffers and handles stay alive: peers mapped them


def _p2p_steps(group_name: str) -> list[tuple[str, Callable[[], None]]]:
    """The real test: allocate, rendezvous, write a per-rank pattern, barrier, read every
    peer's buffer over P2P and compare; then ``symm_mem.one_shot_all_reduce`` on it."""
    n = 1024
    state: dict = {}

    def pattern(rank: int) -> torch.Tensor:  # exact in fp32, different on every rank
        i = torch.arange(n, dtype=torch.float32, device=state["buf"].device)
        return (rank + 1) * 1000.0 + i

    def allocate():
        from torch.distributed import _symmetric_memory as symm

        _safe_env()
        _enable(group_name)
        state["buf"] = symm.empty(n, dtype=torch.float32,
                                  device=torch.device("cuda", torch.cuda.current_device()))

    def rendezvous():
        from torch.distributed import _symmetric_memory as symm

        hdl = symm.rendezvous(state["buf"], group_name)
        pg = resolve_group(group_name)
        if (hdl.rank, hdl.world_size) != (pg.rank(), pg.size()):
            raise RuntimeError(f"handle says rank {hdl.rank} of {hdl.world_size}, group says "
                               f"{pg.rank()} of {pg.size()}")
        if hdl.buffer_ptrs[hdl.rank] != state["buf"].data_ptr():
            raise RuntimeError("buffer_ptrs[rank] is not the tensor's address (an offset "
                               "handle): the kernels' pointer table would be wrong")
        state["hdl"] = hdl
        _PROBES.append((state["buf"], hdl))

    def read_peers():
        hdl, buf = state["hdl"], state["buf"]
        buf.copy_(pattern(hdl.rank))
        hdl.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        for peer in range(hdl.world_size):
            seen = hdl.get_buffer(peer, (n,), torch.float32).clone()
            if not torch.equal(seen, pattern(peer)):
                bad = int((seen != pattern(peer)).sum())
                raise RuntimeError(f"read {bad} of {n} wrong values from peer {peer}'s buffer")
        hdl.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)  # peers done reading ours

    def one_shot():
        hdl, buf = state["hdl"], state["buf"]
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
        want = sum(pattern(r) for r in range(hdl.world_size))
        torch.cuda.synchronize()
        if not torch.equal(out, want):
            err = float((out - want).abs().max())
            raise RuntimeError(f"one_shot_all_reduce off by up to {err} from the exact sum")

    return [("allocate", allocate), ("rendezvous", rendezvous),
            ("P2P read of every peer", read_peers), ("one_shot_all_reduce", one_shot)]


def symm_mem_ready(group_name: str) -> tuple[bool, str]:
    """Whether this group's ranks can use symmetric memory over P2P: (True, "ok") or
    (False, reason), the same answer on every rank of the group.

    On CPU, gloo, a fake group or an unknown name it answers False at once, without any
    collective (those facts are shared by all ranks). Otherwise it is a collective, once
    per group per process (cached): it tests P2P for real (see ``_p2p_steps``) instead of
    trusting the driver, and every rank takes the verdict of the worst rank. A check that
    raises on a rank becomes that rank's reason (only a failing vote itself, a broken group,
    raises). Call it outside CUDA-graph capture: there it raises unless already cached.
    """
    if group_name in _READY:
        return _READY[group_name]
    why = _precheck(group_name)
    if why:
        _READY[group_name] = (False, why)
        return _READY[group_name]
    if capturing():
        raise RuntimeError(f"symm_mem_ready({group_name!r}) is a collective set-up check and "
                           "cannot run during CUDA-graph capture; call it (or run the graph "
                           "once eagerly) before capturing")
    _READY[group_name] = run_agreed_steps(resolve_group(group_name), _p2p_steps(group_name))
    return _READY[group_name]


@dataclass
class Workspace:
    """A symmetric buffer of ``nbytes`` on every rank, and its rendezvous handle."""

    tensor: torch.Tensor
    handle: object  # torch._C._distributed_c10d._SymmetricMemory
    nbytes: int
    max_blocks: int
    """Most thread blocks a kernel may barrier with: one signal slot per (block, peer)."""


_WORKSPACES: dict[tuple[str, int], Workspace] = {}
_RETIRED: list[Workspace] = []
"""Outgrown workspaces are never freed: a CUDA graph captured earlier still points at them."""

MAX_BLOCKS = 32


def _signal_pad_bytes(handle=None) -> int:
    """Signal pad bytes per allocation: the handle's own figure, else this torch's setting,
    else 1024 B (32 blocks x 8 ranks x 4 B), the smallest default of torch 2.11-2.13."""
    from torch.distributed import _symmetric_memory as symm

    for size in (lambda: handle.signal_pad_size, symm.get_signal_pad_size):
        try:
            return int(size())
        except Exception:  # an older torch without it, or no handle
            continue
    return 1024


def get_workspace(group_name: str, device: torch.device, nbytes: int) -> Workspace:
    """The workspace of (group, device), at least ``nbytes``; (re)allocated collectively when
    the largest request so far grows (to a power of two, at least ``MIN_WORKSPACE_BYTES``).

    Every rank reaches the same (re)allocations in the same order, since ``nbytes`` comes from
    the shapes and dtypes the op is called with. Allocation must not happen during CUDA-graph
    capture (a rendezvous synchronises the device and talks to the store): Inductor's CUDA-
    graph trees run each graph eagerly once before recording, which allocates; a capture that
    still needs a larger workspace raises. The allocation runs on a side stream so that the
    handle's pointer tables, which torch allocates from the caching allocator, never come from
    a CUDA-graph memory pool active on the current stream.
    """
    ws = _WORKSPACES.get((group_name, device.index))
    if ws is not None and ws.nbytes >= nbytes:
        return ws
    if capturing():
        have = 0 if ws is None else ws.nbytes
        raise RuntimeError(
            f"fxcoalesce: the symmetric workspace of group {group_name!r} holds {have} bytes "
            f"but this call needs {nbytes}, and it cannot grow during CUDA-graph capture (a "
            "collective rendezvous). Run the graph once eagerly before capturing (CUDA-graph "
            "trees do), or call fxcoalesce.kernels.symm.get_workspace(group_name, device, "
            f"{nbytes}) on every rank first.")
    return _register(group_name, device, _allocate(group_name, device, nbytes))


def _allocate(group_name: str, device: torch.device, nbytes: int) -> torch.Tensor:
    """A new workspace tensor in symmetric memory for ``nbytes`` (local: no peer takes part)."""
    from torch.distributed import _symmetric_memory as symm

    _safe_env()
    _enable(group_name)
    size = max(MIN_WORKSPACE_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        tensor = symm.empty(size, dtype=torch.uint8, device=device)
    stream.synchronize()
    return tensor


def _register(group_name: str, device: torch.device, tensor: torch.Tensor) -> Workspace:
    """Rendezvous ``tensor`` with the group's peers (collective) and make it the workspace."""
    from torch.distributed import _symmetric_memory as symm

    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        handle = symm.rendezvous(tensor, group_name)
    stream.synchronize()
    if handle.buffer_ptrs[handle.rank] != tensor.data_ptr():
        raise RuntimeError("fxcoalesce: symmetric workspace handle does not start at the "
                           "tensor (offset handle); the kernel's pointer table would be wrong")
    world = handle.world_size
    max_blocks = min(MAX_BLOCKS, _signal_pad_bytes(handle) // (4 * world))
    key = (group_name, device.index)
    if key in _WORKSPACES:
        _RETIRED.append(_WORKSPACES[key])
    _WORKSPACES[key] = Workspace(tensor, handle, tensor.numel(), max_blocks)
    return _WORKSPACES[key]


def prepare(group_name: str, device: torch.device, nbytes: int) -> tuple[bool, str]:
    """Before a compiled graph first runs: size the workspace for its largest symmetric-memory
    all_reduce and run one copy-in one-shot, so that every allocation and rendezvous (the
    workspace's and torch's own, with its pointer tables) happens here, outside any CUDA-graph
    pool. Collective: every rank calls it for the same groups in the same order (they agreed
    on the graph's collectives). Each step is voted on (``run_agreed_steps``): a rank whose
    allocation fails (out of memory, say) stops every rank before the rendezvous, and all
    return the same (False, reason)."""
    state: dict = {}
    ws = _WORKSPACES.get((group_name, device.index))
    grow = ws is None or ws.nbytes < max(nbytes, 1)  # rank-invariant: the agreed sizes

    def probe():
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            x = torch.zeros(8, dtype=torch.bfloat16, device=device)
            torch.ops.fxcoalesce.one_shot_all_reduce(x, group_name)
        stream.synchronize()

    steps = [("probe", probe)]
    if grow:
        steps[:0] = [("allocate", lambda: state.update(t=_allocate(group_name, device, nbytes))),
                     ("rendezvous", lambda: _register(group_name, device, state["t"]))]
    return run_agreed_steps(resolve_group(group_name), steps)
