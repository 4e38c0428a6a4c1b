"""One way to time a step, shared by ``bench`` and ``demo`` so their numbers compare.

    out, us = timed(lambda: step(*args), device)

On CUDA the time is between two events recorded around the call on the current stream: the
GPU's own time for the work launched, not the host's launch time; elsewhere it is wall time.
"""

from __future__ import annotations

import time

import torch


def timed(fn, device: torch.device | str):
    """Run ``fn()`` once; return its result and how long it took, in microseconds."""
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - start) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) * 1e3
