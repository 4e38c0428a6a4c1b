"""Compile times that measure the compile, not the order: shared by ``bench`` and ``demo``.

Two costs make the first of several compiles in one process look slow and the later ones
fast, whatever is compiled (measured on neox-tiny, 2 cores: the second of two compiles took
a third to a half of the first's time, in either order):

- one-time costs of the process: importing Inductor and the passes, starting Inductor's
  compile workers, probing the C++ compiler. :func:`warm_up` pays them before any timing by
  compiling a tiny unrelated graph through Inductor and through the fxcoalesce backend;
- kernels shared between variants: two variants of one step generate mostly the same
  kernels, and Inductor's code cache (on disk and in memory) hands the second variant what
  the first compiled. :func:`own_cache` gives each variant an Inductor cache directory of
  its own and clears the in-memory caches around it, so every variant finds exactly what it
  compiled itself: all cold on a first run, all warm on a rerun (what the cache did is
  reported with each time).

    warm_up(device, group)
    with own_cache("inductor") as info:
        compiled(*args)                        # timed
    info["cache"]                              # "cold", "warm", ...
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

HOW = ("each variant's first call, into an Inductor cache of its own, after an untimed "
       "warm-up compile of a tiny graph that pays the one-time costs")
"""How the compile times are measured, in the words the outputs use."""
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _clear_inductor_memory() -> None:
    from torch._inductor import utils

    (getattr(utils, "clear_caches", None) or utils.clear_inductor_caches)()


def variant_cache_dir(name: str) -> Path:
    """Where variant ``name`` keeps its Inductor cache: under the cache Inductor would use
    (``TORCHINDUCTOR_CACHE_DIR``, else its default), so a rerun finds it warm."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layouts
        from torch._inductor.runtime.runtime_utils import cache_dir

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return Path(cache_dir()) / "fxcoalesce-variants" / safe


def _graph_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def cache_state(hits: int, misses: int) -> str:
    """What Inductor's FX graph cache did for one compile, in a word."""
    if hits and misses:
        return "partly warm"
    return "warm" if hits else "cold" if misses else "uncached"


@contextlib.contextmanager
def own_cache(name: str):
    """Inductor's (and Triton's) caches of variant ``name`` alone while the block runs.
    Yields a dict that holds, after the block, ``"cache"``: what the FX graph cache did
    (:func:`cache_state`: "cold" when every graph was compiled anew)."""
    path = variant_cache_dir(name)
    path.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in CACHE_ENV}
    _clear_inductor_memory()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    info: dict = {}
    hits, misses = _graph_cache_counts()
    try:
        yield info
    finally:
        now = _graph_cache_counts()
        info["cache"] = cache_state(now[0] - hits, now[1] - misses)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _clear_inductor_memory()


def warm_up(device, group=None) -> None:
    """Compile and run a tiny graph (a matmul, an all_reduce over ``group`` when given, an
    elementwise tail) through plain Inductor and through the fxcoalesce backend, in a cache
    of its own: the process's one-time compile costs, paid untimed. Collective when
    ``group`` is: every rank calls it."""
    import torch
    import torch.distributed._functional_collectives as funcol

    from fxcoalesce.compiler import backend
    from fxcoalesce.config import Config

    def tiny(x, w):  # odd sizes: no kernel of it is one of a model's
        y = x @ w
        if group is not None:
            y = funcol.all_reduce(y, "sum", group)
        return torch.relu(y) * 3 + 1

    x = torch.randn(7, 13, device=device)
    w = torch.randn(13, 11, device=device)
    # lower=False: no symmetric buffers, which every rank must allocate alike, for this graph
    with own_cache("warm-up"), torch.no_grad():
        for be in ("inductor", backend(Config(lower=False))):
            torch.compile(tiny, backend=be, fullgraph=True)(x, w)
