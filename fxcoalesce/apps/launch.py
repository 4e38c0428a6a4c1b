"""Start real multi-rank jobs on one machine (gloo on CPU, NCCL on GPUs) and fake groups.

    results = spawn(worker, world_size=2, args=(cfg,))   # worker(rank, world_size, *args)

Each worker runs in its own process with the default process group initialised; the
return values come back in rank order. If a rank fails, the others are stopped and the
first failure is raised as ``RankError`` (type and message; the rank's traceback attached).
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: str = "cuda", world_size: int = 2) -> str:
    """NCCL when the job runs on CUDA and every rank can have its own GPU, else gloo (CPU, or
    CUDA tensors staged through the host)."""
    return "nccl" if device == "cuda" and torch.cuda.device_count() >= world_size else "gloo"


class RankError(RuntimeError):
    """A rank of :func:`spawn` failed: the first failure's rank, exception type (empty when
    the process died or timed out rather than raising) and message; ``.traceback`` is the
    traceback text from the rank's process, when there is one."""

    def __init__(self, rank: int, kind: str, message: str, traceback: str = ""):
        super().__init__(f"rank {rank}: {kind + ': ' if kind else ''}{message}")
        self.rank, self.kind, self.message, self.traceback = rank, kind, message, traceback


NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
"""Kept set for NCCL ranks: NVLink multicast can take a shared host's GPUs down."""


NETNS_ENV = "FXCOALESCE_RANK_NETNS"
"""Network namespaces (``ip netns``) for the ranks, one each, and the first rank's address in
its own: ``fxc0,fxc1@10.77.0.1``. Each rank enters its namespace before its process group
starts, so the ranks talk as separate hosts over a link one can shape
(``benchmarks/netns_link.sh``; set ``GLOO_SOCKET_IFNAME`` to the link's interface)."""


def _enter_netns(spec: str, rank: int) -> str:
    """Move this rank's process into its namespace of ``spec`` (:data:`NETNS_ENV`); return
    the address its process group meets at."""
    import ctypes

    names, _, host = spec.partition("@")
    names = names.split(",")
    if rank >= len(names) or not host:
        raise ValueError(f"{NETNS_ENV}={spec!r}: give one namespace per rank and the first "
                         "rank's address, e.g. fxc0,fxc1@10.77.0.1")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{names[rank]}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET: this (the only) thread
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {names[rank]}")
    finally:
        os.close(fd)
    return host


def _thread_lock_for_tqdm() -> None:
    """tqdm makes a multiprocessing lock, a named semaphore registered with the parent's
    resource tracker, for the first bar it draws (Inductor draws some); a rank stopped from
    outside (Ctrl-C in the parent, a failed peer) cannot unregister it, and the tracker then
    warns of leaked semaphores as the command exits. A rank's bars share no lock with
    another process: tqdm's thread lock is enough (its own choice where multiprocessing
    locks cannot be had)."""
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None


def _entry(rank, world_size, port, backend, fn, args, queue, done, env, group_timeout_s,
           parent_env=None, ignore_sigint=False):
    try:
        if ignore_sigint:  # as the parent asked (a forked rank has the server's handlers)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if parent_env is not None:  # the parent's environment now, not the server's at start
            os.environ.clear()
            os.environ.update(parent_env)
        _thread_lock_for_tqdm()
        os.environ.update(env or {})
        extra = {}
        if group_timeout_s is not None:
            import datetime

            extra["timeout"] = datetime.timedelta(seconds=group_timeout_s)
        if backend == "nccl":
            os.environ.update(NCCL_SAFE_ENV)
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)
        else:  # loopback: these jobs never leave the machine
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        host = _enter_netns(os.environ[NETNS_ENV], rank) if os.environ.get(NETNS_ENV) \
            else "127.0.0.1"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}",
                                rank=rank, world_size=world_size, **extra)
        queue.put((rank, None, fn(rank, world_size, *args)))
    except BaseException as e:  # reported before any teardown that could block on peers
        queue.put((rank, (type(e).__name__, str(e), traceback.format_exc()), None))
        done.wait(timeout=600)
        return
    _teardown(rank)
    done.wait(timeout=600)  # tensors in the result are shared memory: live until received
    queue.close()
    queue.join_thread()  # everything put is in the pipe before the process ends
    # what atexit would finalize: semaphores this rank made (tqdm's lock, which Inductor's
    # progress bar creates) unregister from the parent's resource tracker, which otherwise
    # warns at exit that they leaked
    multiprocessing.util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is delivered: no interpreter teardown (CUDA graphs, NCCL) to hang


TEARDOWN_S = 20.0
"""How long a rank that delivered its result waits for ``destroy_process_group``."""


def _teardown(rank: int) -> None:
    """``destroy_process_group`` with a time limit. With NCCL and CUDA graphs still alive it
    can block (seen on two H200s: each rank stayed until the parent killed it a minute
    later); a rank that already delivered its result then exits without it."""
    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(TEARDOWN_S)
    if t.is_alive():
        print(f"rank {rank}: destroy_process_group did not return within {TEARDOWN_S:.0f} s; "
              "exiting without it", file=sys.stderr, flush=True)


def _dead(procs, received, within: float = 0.0):
    """(rank, failure) of a rank whose process ended without reporting (killed, crashed in
    C++), waiting up to ``within`` seconds for one to show; None if there is none."""
    end = time.monotonic() + within
    while True:
        for rank, p in enumerate(procs):
            if rank not in received and p.exitcode is not None:
                return rank, ("", f"its process exited with code {p.exitcode} before returning "
                              "a result", "")
        if time.monotonic() >= end:
            return None
        time.sleep(0.05)


def _next_report(queue, procs, received, deadline: float):
    """The next (rank, failure, result): from ``queue``, or a failure for a rank that died
    without reporting, or for the first silent rank once ``deadline`` has passed."""
    while True:
        dead = _dead(procs, received)
        if dead:
            return *dead, None
        left = deadline - time.monotonic()
        if left <= 0:
            rank = next(r for r in range(len(procs)) if r not in received)
            return rank, ("", "no result within spawn's timeout", ""), None
        try:
            return queue.get(timeout=min(left, 1.0))
        except Empty:
            continue


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (its children, theirs, ...), read from Linux's /proc;
    none where there is no /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        children.setdefault(ppid, []).append(int(name))
    below, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            below.append(child)
            todo.append(child)
    return below


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(procs, failed: bool) -> None:
    """Let finished ranks exit; after a failure (or Ctrl-C), terminate the others at once
    (they may be blocked in a collective waiting for the failed rank) and kill any that
    ignore it, with what they started (Inductor's compile workers and their compilers,
    which would outlive the rank: they ignore SIGINT)."""
    below = []
    if failed:
        below = [d for p in procs if p.is_alive() for d in _descendants(p.pid)]
        for p in procs:
            if p.is_alive():
                p.terminate()
        _signal_all(below, signal.SIGTERM)
    end = time.monotonic() + (5 if failed else TEARDOWN_S + 10)
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            if not failed:
                print(f"rank {rank} did not exit after delivering its result; killed",
                      file=sys.stderr, flush=True)
            p.kill()
            p.join()
    _signal_all([d for d in below if os.path.exists(f"/proc/{d}")], signal.SIGKILL)


@contextlib.contextmanager
def _ranks_ignore_sigint():
    """Processes started inside ignore SIGINT: Ctrl-C reaches every process of the terminal's
    group, and a rank would answer it with a traceback of its own (one per rank, even while
    it imports torch). The parent alone takes it (KeyboardInterrupt) and stops the ranks
    (:func:`_stop`). An ignored signal stays ignored across exec, and Python installs its
    KeyboardInterrupt handler only where SIGINT is not ignored. Off the main thread (where
    no handler can be set) nothing changes. Yields whether the ranks are to ignore it (a
    rank forked from the server sets that itself: :func:`_entry`)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if before is None else before)


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx"]
"""What the ranks' fork server imports once (``forkserver``): each rank then starts without
importing torch, Dynamo and Inductor again (3-3.5 s of CPU a rank on these cores; the tests
start hundreds)."""

_READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_")
"""Variables those imports may read once, at import (``TORCH_LOGS``, ``TORCHINDUCTOR_*``
config, thread counts): a spawn whose environment differs in them from the server's start
gets fresh processes (``spawn``) instead."""
_READ_LATER = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TORCHELASTIC_RESTART_COUNT",
                         "TORCH_SYMM_MEM_DISABLE_MULTICAST"})
_server_env: dict[str, str] | None = None


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT)
            and k not in _READ_LATER}


def _context(env: dict[str, str] | None = None):
    """Ranks fork from a server that imported :data:`PRELOAD` (``forkserver``, Linux, no
    CUDA) where the environment those imports read is the one the server started with;
    ``spawn`` elsewhere. Each rank takes the parent's environment as it is at the spawn
    (:func:`_entry`), not the server's."""
    global _server_env
    wanted = _import_env({**os.environ, **(env or {})})
    if "forkserver" not in mp.get_all_start_methods() or \
            _server_env not in (None, wanted) or torch.cuda.is_available():
        # CUDA: a rank forked from the server could not start it ("Cannot re-initialize
        # CUDA in forked subprocess", found on the GPU machine): fresh processes there
        return mp.get_context("spawn")
    _server_env = wanted
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn(fn, world_size: int, args: tuple = (), backend: str | None = None,
          timeout: float = 1800.0, env: dict[str, str] | None = None,
          group_timeout_s: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results.
    ``env`` is set in each rank before its process group starts (e.g. NCCL_P2P_DISABLE);
    ``group_timeout_s`` is the process group's timeout (a collective that never pairs fails
    after it: tests that could hang set a few seconds).

    The first rank to fail (raise, die, or not answer within ``timeout`` seconds overall) is
    raised as :class:`RankError`, after every other rank has been stopped.
    """
    backend = backend or default_backend(world_size=world_size)
    ctx = _context(env)
    queue, done = ctx.Queue(), ctx.Event()
    port = free_port()
    with _ranks_ignore_sigint() as ignore:
        procs = [ctx.Process(target=_entry,
                             args=(r, world_size, port, backend, fn, args, queue, done, env,
                                   group_timeout_s, dict(os.environ), ignore))
                 for r in range(world_size)]
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout
    results, failure = {}, None
    try:
        while failure is None and len(results) < world_size:
            rank, failure, value = _next_report(queue, procs, results, deadline)
            if failure is None:
                results[rank] = value
            else:  # a peer's death surfaces as errors in the others' collectives: blame it
                rank, failure = _dead(procs, results, within=1.0) or (rank, failure)
    finally:
        done.set()
        _stop(procs, failed=failure is not None or len(results) < world_size)
    if failure is not None:
        raise RankError(rank, *failure)
    return [results[r] for r in range(world_size)]


def init_fake_group(world_size: int) -> dist.ProcessGroup:
    """A fake default process group of ``world_size`` (rank 0): traces without peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world_size and dist.get_backend() == "fake":
            return dist.group.WORLD
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return dist.group.WORLD

