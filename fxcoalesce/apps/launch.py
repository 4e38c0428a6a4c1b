"""Start real multi-rank jobs on one machine (gloo on CPU, NCCL on GPUs) and fake groups.

    results = spawn(worker, world_size=2, args=(cfg,))   # worker(rank, world_size, *args)

Each worker runs in its own process with the default process group initialised; the
return values come back in rank order.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """NCCL when every rank can have its own GPU, else gloo (CPU or host-staged CUDA)."""
    return "nccl" if torch.cuda.device_count() >= 2 else "gloo"


def _entry(rank, world_size, port, backend, fn, args, queue, done):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:  # loopback: these jobs never leave the machine
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size)
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    done.wait(timeout=600)  # tensors in the result are shared memory: live until received


def spawn(fn, world_size: int, args: tuple = (), backend: str | None = None,
          timeout: float = 1800.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results."""
    backend = backend or default_backend()
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, queue, done))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = value
    finally:
        done.set()
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
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

