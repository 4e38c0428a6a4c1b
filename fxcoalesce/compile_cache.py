"""Safe compile caching for the backend: Inductor's caches keyed on fxcoalesce, and what a
cache hit must still tell (the report, the collective sequences the ranks compare).

Inductor has two caches. The FX graph cache keys on the graph ``compile_fx_inner`` is given,
which for the backend is the already-rewritten graph, plus Inductor's config. AOTAutograd's
cache keys on the Dynamo graph and the config, before the passes run: without more, it would
hand plain ``torch.compile``'s code to an fxcoalesce compile, or the reverse. The backend
therefore puts a :class:`KeyedPass` into the config of its compiles: a no-op
``post_grad_custom_pre_pass`` (it runs whatever pass the user had set there) whose ``uuid()``
hashes the pass sources, the ``Config`` and the process-group setup, so both caches key on
them. ``KeyedPass(key=None)`` makes Inductor skip its caches (``uuid() is None``); the
backend uses that where it needs AOTAutograd to run (it reinstates the key for the FX graph
cache inside ``inner_compile``).

An AOTAutograd hit skips ``inner_compile``, so the passes do not run and say nothing. The
backend saves, beside Inductor's cache (``<cache dir>/fxcoalesce/<key>.json``), what it
needs on such a hit: the reports, the program's and the rewritten graph's collective
sequences (the program's, and each agreement step's: a rank served from the cache agrees
with its peers as one that compiles). The key (:func:`entry_key`) hashes the compile key
(which names the agreed step), the Dynamo graph's code and its example inputs' metadata. A hit without a saved entry is compiled again with AOTAutograd's
cache skipped (correct, only slower).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger("fxcoalesce")
VERSION = 2
"""Bumped when the saved entry's layout changes."""


def source_files() -> list[Path]:
    """The files whose text defines what the passes do (core, passes, rank safety, and the
    kernels whose schemas and fake implementations the rewritten graphs are compiled against)."""
    import fxcoalesce.passes as passes

    here = Path(__file__).parent
    roots = [here, Path(passes.__file__).parent, here / "kernels", here / "ranks"]
    return sorted(p for root in roots for p in root.glob("*.py"))


def source_fingerprint(files: list[Path] | None = None) -> str:
    h = hashlib.sha256()
    for p in files if files is not None else source_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


class KeyedPass(CustomGraphPass):
    """Inductor's ``post_grad_custom_pre_pass`` that runs ``inner`` (the user's pass, or
    nothing) and keys Inductor's caches on ``key`` (None: no caching)."""

    def __init__(self, inner, key: str | None):
        self.inner, self.key = inner, key

    def __call__(self, graph) -> None:
        for p in self._inner_passes():
            p(graph)

    def uuid(self) -> str | None:
        inner = None
        if self.inner is not None:
            uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None
                     for p in self._inner_passes()]
            if any(u is None for u in uuids):
                return None
            inner = uuids[0] if len(uuids) == 1 and not isinstance(self.inner, (list, tuple)) \
                else tuple(uuids)
        return None if self.key is None else f"fxcoalesce-{self.key}-{inner}"

    def _inner_passes(self) -> tuple:
        """The passes ``inner`` holds, less a ``custom_pass_context`` hook where this pass is
        itself one of the context's (Inductor put it there from the config patch): the
        context runs its passes itself, this one among them; through the hook again they
        would run twice, and this pass call itself for ever."""
        from torch._inductor import custom_graph_pass as cgp

        is_hook = getattr(cgp, "_is_custom_pass_context_wrapper", None)
        active = getattr(cgp, "get_active_passes", None)
        passes = _passes(self.inner)
        if is_hook is None or active is None or not any(is_hook(p) for p in passes):
            return passes
        registered = active().post_grad_pre_passes
        if not any(p is self for p in registered):
            return passes
        return tuple(p for p in passes if not is_hook(p))


def _passes(custom) -> tuple:
    """The passes an Inductor custom-pass option holds: none, one, or (torch 2.15) a list."""
    if custom is None:
        return ()
    return tuple(custom) if isinstance(custom, (list, tuple)) else (custom,)


def group_setup_key() -> str:
    """The default process group's backend and size: the cost model and the lowering read
    them, and a Dynamo graph names groups only by name."""
    if not (dist.is_available() and dist.is_initialized()):
        return "no process group"
    return f"{dist.get_backend()}:{dist.get_world_size()}"


def compile_key(fingerprint: str, config_repr: str, patches: dict) -> str:
    """What every compile of the backend with this configuration shares: the passes' source,
    the Config, the group setup, the Inductor patches, and whether Inductor's global config
    asks for CUDA graphs (the lowering rewrites differently then)."""
    from .lowering import under_cudagraphs
    from .testing import reference_lowering_active

    from .torch_internals import disabled

    text = "|".join([fingerprint, config_repr, group_setup_key(), _describe_patches(patches),
                     f"cudagraphs={under_cudagraphs()}",
                     f"reference={reference_lowering_active()}",
                     f"off={','.join(sorted(disabled()))}"])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _describe_patches(patches: dict) -> str:
    def value(v):
        if isinstance(v, (bool, int, float, str, type(None))):
            return repr(v)
        if isinstance(v, (list, tuple)):  # e.g. reorder_for_compute_comm_overlap_passes
            return f"[{', '.join(map(value, v))}]"
        uuid = getattr(v, "uuid", None)
        return f"{type(v).__qualname__}:{uuid() if callable(uuid) else id(v)}"

    return repr(sorted((k, value(v)) for k, v in patches.items()))


def _describe_input(x) -> str:
    if isinstance(x, torch.Tensor):
        return (f"T({type(x).__name__},{tuple(x.shape)},{tuple(x.stride())},{x.dtype},"
                f"{x.device},{x.requires_grad})")
    return f"{type(x).__name__}({x})"


def entry_key(compile_key: str, gm: torch.fx.GraphModule, example_inputs) -> str:
    """The saved entry of one Dynamo graph compiled with ``compile_key``."""
    devices = getattr(torch._C, "_autocast_supported_devices", lambda: ("cpu", "cuda"))()
    autocast = [(d, torch.get_autocast_dtype(d)) for d in devices if torch.is_autocast_enabled(d)]
    constants = [(n.target, _describe_input(getattr(gm, n.target, None)))
                 for n in gm.graph.find_nodes(op="get_attr")]
    text = "|".join([f"v{VERSION}", torch.__version__, compile_key, gm.code,
                     ";".join(map(_describe_input, example_inputs)), repr(constants),
                     repr(torch.is_grad_enabled()), repr(autocast)])
    return hashlib.sha256(text.encode()).hexdigest()


def _directory() -> Path:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layouts
        from torch._inductor.runtime.runtime_utils import cache_dir
    return Path(cache_dir()) / "fxcoalesce"


def _off() -> bool:
    from .torch_internals import disabled

    return "compile-cache" in disabled()  # this torch moved Inductor's cache_dir


def save(key: str, entry: dict) -> None:
    """Write ``entry`` atomically (ranks sharing the directory may write the same key)."""
    if _off():
        return
    directory = _directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entry, default=str))
        tmp.replace(directory / f"{key}.json")
    except OSError as e:  # an unwritable cache costs a recompile on the next hit, no more
        log.warning("fxcoalesce: cannot save the compile-cache entry in %s: %s", directory, e)


def load(key: str) -> dict | None:
    if _off():  # no entry: a cache hit compiles again, with AOTAutograd's cache skipped
        return None
    path = _directory() / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
