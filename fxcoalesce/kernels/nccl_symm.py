"""``torch.ops.fxcoalesce.nccl_symm_all_reduce(Tensor input, str group_name) -> Tensor``:
NCCL's own all_reduce on a buffer registered as an NCCL symmetric window (issue 22 §1).

NCCL >= 2.27 runs low-latency symmetric kernels when an all_reduce's buffer lies in a window
every rank registered (``ncclCommWindowRegister``); torch >= 2.10 makes such buffers with
``_symmetric_memory.set_backend("NCCL")``, then ``empty`` + ``rendezvous``. The op copies
``input`` into fxcoalesce's registered workspace of the group, runs c10d's in-place
``all_reduce`` there, and returns a copy of the sum (the workspace is reused by the next
call, so the result cannot stay in it). The copy in is the price of CUDA graphs: buffers
Inductor allocates inside a graph's pool cannot be registered windows (``one_shot``'s
``CUDAGRAPH_P2P`` in ``fxcoalesce.lowering``), so the producer cannot write there.

The backend is process-wide: torch fixes it at the first symmetric allocation ("the backend
cannot be changed once a symmetric memory tensor has been allocated"), and the one-shot,
two-shot and fused kernels are only known to work on torch's default ``CUDA`` backend. So a
process runs ``nccl_symm`` or the others, never both (``fxcoalesce.lowering.backend_problem``);
the user picks NCCL's with ``use_nccl_backend()`` (or ``set_backend("NCCL")``) before anything
allocates symmetric memory, on every rank.

Rank safety, as ``symm``: ``ready`` tests the window for real (allocate, rendezvous, an exact
c10d sum on it) and ``prepare`` sizes the workspace before any capture, each step voted on
(``symm.run_agreed_steps``), so every rank takes the same path. Reference (any device): c10d
all_reduce of a copy, identity without peers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import symm
from .one_shot import _reference  # the same sum: c10d's all_reduce of a copy

NCCL = "NCCL"
OP_NAME = "fxcoalesce::nccl_symm_all_reduce"

_lib = torch.library.Library("fxcoalesce", "FRAGMENT")
_lib.define("nccl_symm_all_reduce(Tensor input, str group_name) -> Tensor")


def process_backend() -> str | None:
    """torch's symmetric-memory backend for CUDA in this process ("CUDA", "NCCL",
    "NVSHMEM"), or None when torch cannot say (no CUDA build, an older torch)."""
    try:
        from torch.distributed import _symmetric_memory as sm

        return sm.get_backend(torch.device("cuda"))
    except Exception:  # a CPU wheel or a torch without get_backend
        return None


def use_nccl_backend() -> tuple[bool, str]:
    """Make NCCL's symmetric memory this process's backend: (True, "ok") or (False, why,
    e.g. a symmetric tensor was already allocated on another backend). Call it on every
    rank, before anything allocates symmetric memory."""
    if process_backend() == NCCL:
        return True, "ok"
    try:
        from torch.distributed import _symmetric_memory as sm

        symm._safe_env()
        sm.set_backend(NCCL)
    except Exception as e:
        return False, f"set_backend('NCCL'): {type(e).__name__}: {str(e).splitlines()[0]}"
    now = process_backend()
    return (True, "ok") if now == NCCL else (False, f"set_backend('NCCL') left it at {now}")


@torch.library.register_fake(OP_NAME)
def _fake(input, group_name):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


_READY: dict[str, tuple[bool, str]] = {}
_PROBES: list = []  # registered buffers peers mapped stay alive
_WORKSPACES: dict[tuple[str, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
"""Outgrown workspaces are never freed: a CUDA graph captured earlier still points at them."""


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer of ``nbytes`` on this process's symmetric-memory backend (local)."""
    from torch.distributed import _symmetric_memory as sm

    symm._safe_env()
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        t = sm.empty(nbytes, dtype=torch.uint8, device=device)
    stream.synchronize()
    return t


def _register(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Rendezvous ``t`` with the group's peers (collective): NCCL registers it as a window."""
    from torch.distributed import _symmetric_memory as sm

    stream = torch.cuda.Stream(t.device)
    with torch.cuda.device(t.device), torch.cuda.stream(stream):
        _PROBES.append((t, sm.rendezvous(t, group_name)))
    stream.synchronize()
    return t


def _install(group_name: str, t: torch.Tensor) -> torch.Tensor:
    key = (group_name, t.device.index)
    if key in _WORKSPACES:
        _RETIRED.append(_WORKSPACES[key])
    _WORKSPACES[key] = t
    return t


def _size(nbytes: int) -> int:
    return max(symm.MIN_WORKSPACE_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())


def _ready_steps(group_name: str) -> list:
    n, state = 1024, {}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")

    def backend():
        if (now := process_backend()) != NCCL:
            raise RuntimeError(f"this process's symmetric-memory backend is {now}, not NCCL's "
                               "(fxcoalesce.kernels.nccl_symm.use_nccl_backend() first)")

    def allocate():
        state["buf"] = _allocate(n * 4, device)

    def register():
        state["buf"] = _register(state["buf"], group_name).view(torch.float32)

    def exact_sum():
        pg = symm.resolve_group(group_name)
        buf = state["buf"]
        i = torch.arange(n, dtype=torch.float32, device=buf.device)
        buf.copy_((pg.rank() + 1) * 1000.0 + i)  # exact in fp32, different on every rank
        dist.all_reduce(buf, group=pg)
        w = pg.size()
        want = 1000.0 * w * (w + 1) / 2 + w * i
        if not torch.equal(buf, want):
            raise RuntimeError(f"all_reduce on the window off by up to "
                               f"{float((buf - want).abs().max())} from the exact sum")

    return [("symmetric-memory backend", backend), ("allocate", allocate),
            ("rendezvous (window registration)", register),
            ("exact all_reduce on the window", exact_sum)]


def ready(group_name: str) -> tuple[bool, str]:
    """Whether the group's ranks can run ``nccl_symm``: the same answer on every rank, a
    collective on the first call per group (cached), as ``symm.symm_mem_ready``."""
    if group_name in _READY:
        return _READY[group_name]
    if why := symm._precheck(group_name):
        _READY[group_name] = (False, why)
        return _READY[group_name]
    if symm.capturing():
        raise RuntimeError(f"nccl_symm.ready({group_name!r}) is a collective set-up check and "
                           "cannot run during CUDA-graph capture")
    pg = symm.resolve_group(group_name)
    _READY[group_name] = symm.run_agreed_steps(pg, _ready_steps(group_name))
    return _READY[group_name]


def get_workspace(group_name: str, device: torch.device, nbytes: int) -> torch.Tensor:
    """The registered workspace of (group, device), at least ``nbytes`` (a power of two, at
    least ``symm.MIN_WORKSPACE_BYTES``); grown collectively, never during capture."""
    key = (group_name, device.index)
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.numel() >= nbytes:
        return ws
    if symm.capturing():
        have = 0 if ws is None else ws.numel()
        raise RuntimeError(f"fxcoalesce: the NCCL window of group {group_name!r} holds {have} "
                           f"bytes but this call needs {nbytes}, and it cannot grow during "
                           "CUDA-graph capture; run the graph once eagerly first")
    return _install(group_name, _register(_allocate(_size(nbytes), device), group_name))


def prepare(group_name: str, device: torch.device, nbytes: int) -> tuple[bool, str]:
    """Before a compiled graph first runs: the readiness check, the workspace sized for its
    largest ``nccl_symm`` all_reduce, and one call of the op, each step voted on."""
    ok, why = ready(group_name)
    if not ok:
        return ok, why

    def probe():
        torch.ops.fxcoalesce.nccl_symm_all_reduce(
            torch.zeros(8, dtype=torch.bfloat16, device=device), group_name)
        torch.cuda.synchronize(device)

    state: dict = {}
    ws = _WORKSPACES.get((group_name, device.index))
    steps = [("probe", probe)]
    if ws is None or ws.numel() < max(nbytes, 1):  # rank-invariant: the agreed sizes
        steps[:0] = [("allocate", lambda: state.update(t=_allocate(_size(nbytes), device))),
                     ("rendezvous", lambda: _install(group_name,
                                                     _register(state["t"], group_name)))]
    return symm.run_agreed_steps(symm.resolve_group(group_name), steps)


def _cuda(input, group_name):
    if not ready(group_name)[0]:
        return _reference(input, group_name)
    x = input.contiguous()
    nbytes = x.numel() * x.element_size()
    buf = get_workspace(group_name, x.device, nbytes)[:nbytes].view(x.dtype).view(x.shape)
    buf.copy_(x)
    dist.all_reduce(buf, group=symm.resolve_group(group_name))
    return buf.clone()


_lib.impl("nccl_symm_all_reduce", _reference, "CompositeExplicitAutograd")
_lib.impl("nccl_symm_all_reduce", _cuda, "CUDA")
