"""``fxcoalesce doctor``: what this machine's torch gives fxcoalesce, in at most 20 lines.

The torch version beside the tested range, each torch internal's canary (``torch_internals``),
the GPUs, NCCL, symmetric memory, and where fxcoalesce caches. Exit status 1 when a canary
fails (then the line names what is turned off on this torch), else 0.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

WIDTH = 110
"""A passing canary's line is cut to this width (a failing one is shown whole)."""


def _fit(text: str) -> str:
    return text if len(text) <= WIDTH else text[:WIDTH - 1] + "\u2026"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from fxcoalesce import torch_internals as ti

    try:
        own = version("fxcoalesce")
    except PackageNotFoundError:
        own = "not installed"
    tv = str(torch.__version__)
    if ti.is_tested(tv):
        where = "in range"
    elif ti.version_tuple(tv) > ti.TESTED_TO:
        where = "newer than tested: the canaries below decide what runs"
    else:
        where = "older than tested"
    py = ".".join(map(str, sys.version_info[:3]))
    return f"torch {tv}, tested {ti.tested_range()}: {where} (fxcoalesce {own}, Python {py})"


def _gpus() -> str:
    import torch

    if not torch.cuda.is_available():
        build = (f"a CUDA {torch.version.cuda} build, no device visible" if torch.version.cuda
                 else "a CPU build of torch")
        return f"GPUs: none ({build})"
    names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return "GPUs: " + ", ".join(f"{n} x {name}" for name, n in names.items())


def _nccl() -> str:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return "NCCL: not in this build (gloo only)"
    try:
        v = torch.cuda.nccl.version()
        ver = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001 (a build that cannot say)
        ver = f"version unknown ({type(e).__name__})"
    usable = "usable" if torch.cuda.is_available() else "built in, but no GPU to run it on"
    return f"NCCL: {ver}, {usable}"


def _symm_mem(canary_ok: bool) -> str:
    import torch

    if not canary_ok:
        return "symmetric memory: off (its canary failed)"
    if not torch.cuda.is_available():
        return "symmetric memory: torch's ops are here; no GPU, so nothing to lower to them"
    import torch.distributed._symmetric_memory as sm

    parts = [f"ops present, {torch.cuda.device_count()} GPU(s)"]
    if torch.cuda.device_count() > 1:
        p2p = torch.cuda.can_device_access_peer(0, 1)
        parts.append(f"P2P between GPU 0 and 1: {'yes' if p2p else 'no'}")
    try:
        parts.append(f"NVSHMEM: {'yes' if sm.is_nvshmem_available() else 'no'}")
    except Exception:  # noqa: BLE001 (older builds cannot tell)
        pass
    return ("symmetric memory: " + ", ".join(parts)
            + "; each group is tested for real when a graph first lowers to it")


def _caches() -> str:
    from fxcoalesce.apps.spec.smollm2 import cache_dir as weights_dir

    try:
        from fxcoalesce.compile_cache import _directory

        compiled = str(_directory())
    except Exception as e:  # noqa: BLE001 (Inductor's cache_dir moved: its canary says so)
        compiled = f"unknown ({type(e).__name__})"
    return f"caches: compile entries {compiled}; weights {weights_dir()}"


def doctor_lines() -> tuple[list[str], bool]:
    """(the lines to print, whether every canary passed)."""
    from fxcoalesce import torch_internals as ti

    lines = [_versions()]
    start = time.perf_counter()
    results = ti.run_canaries()
    took = time.perf_counter() - start
    lines += [f"  {r}" if not r.ok else _fit(f"  {r}") for r in results]
    failed = [r for r in results if not r.ok]
    lines += [_gpus(), _nccl(), _symm_mem(all(r.ok for r in results if r.name == "symm_mem")),
              _caches()]
    if failed:
        off = sorted({f for r in failed for f in r.guards})
        plain = "; every graph compiles as plain Inductor" if "rewrite" in off else ""
        lines.append(f"\u2718 {len(failed)} of {len(results)} canaries failed ({took:.1f} s): "
                     f"off on this torch: {', '.join(off)}{plain}")
    else:
        lines.append(f"\u2714 all {len(results)} canaries pass ({took:.1f} s): nothing is "
                     "turned off")
    return lines, not failed


def run_doctor(args=None) -> int:
    lines, ok = doctor_lines()
    for line in lines:
        print(line)
    return 0 if ok else 1
