"""torch.compile entry points: the ``fxcoalesce`` backend and the Inductor custom pass.

    torch.compile(fn, backend="fxcoalesce", mode="reduce-overhead")
    torch.compile(fn, backend=fxcoalesce.backend(fxcoalesce.Config(bucket_cap_mb=64)))
    torch._inductor.config.post_grad_custom_post_pass = fxcoalesce.inductor_pass()
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import replace

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from .compile_cache import compile_key, source_fingerprint, source_files  # noqa: F401 (re-exported)
from .config import Config
from .graph_compile import GraphCompile, _raiser, keep, rewrite_graph
from .pipeline import next_graph_name
from .errors import CollectiveMismatchError
from .report import record
from .torch_internals import check_torch
from .torch_internals import comm_reorder_options

log = logging.getLogger("fxcoalesce")
CHECK_RANKS_ENV = "FXCOALESCE_CHECK_RANKS"
PROFILE_ENV = "FXCOALESCE_PROFILE"
DUMP_ENV = "FXCOALESCE_DUMP"
"""A directory: dump every graph the backend compiles there, as ``Config.dump_dir`` does."""


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def inductor_patches(mode: str | None, options: dict | None, codegen: str) -> dict:
    """Inductor config patches for torch.compile's ``mode=`` / ``options=``, checked."""
    if mode is not None and options:
        raise ValueError("give mode= or options=, not both (as torch.compile requires)")
    patches: dict = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        try:
            patches.update(list_mode_options(mode))
        except RuntimeError as e:
            raise ValueError(f"fxcoalesce backend: {e}") from None
    if options:
        known = set(torch._inductor.list_options())
        unknown = sorted(k for k in options if k not in known)
        if unknown:
            raise ValueError(f"fxcoalesce backend: unknown Inductor option(s) {unknown} "
                             "(torch._inductor.list_options() names the known ones)")
        patches.update(options)
    if patches and codegen == "eager":
        raise ValueError(f"fxcoalesce backend: Config(codegen='eager') runs the graph as Python "
                         f"and cannot honour mode={mode!r} / options={options!r}; use "
                         "codegen='inductor'")
    return patches


def _with_env_dump(cfg: Config) -> Config:
    """``cfg`` with ``dump_dir`` from ``FXCOALESCE_DUMP`` when it sets none itself; a dump
    directory that names an existing file is an error here, not in the middle of a compile."""
    if cfg.dump_dir is None and os.environ.get(DUMP_ENV):
        cfg = replace(cfg, dump_dir=os.environ[DUMP_ENV])
        where = f"{DUMP_ENV}={os.environ[DUMP_ENV]!r}"
    else:
        where = f"Config(dump_dir={cfg.dump_dir!r})"
    if cfg.dump_dir is not None and os.path.exists(cfg.dump_dir) and not os.path.isdir(
            cfg.dump_dir):
        raise ValueError(f"{where} names a file, not a directory: give a directory to dump "
                         "the graphs into (it is made if missing)")
    return cfg


def _checked(config, entry: str = "backend") -> Config:
    """``config`` if it is a :class:`Config` (or None), else the one-line error naming the
    fix; also checks the environment the backend reads at compile time."""
    from .ranks.agreement import env_timeout

    if config is not None and not isinstance(config, Config):
        kind = type(config).__name__
        args = (", ".join(f"{k}={v!r}" for k, v in config.items())
                if isinstance(config, dict) else "...")
        raise TypeError(f"fxcoalesce.{entry}() takes a fxcoalesce.Config, not a {kind}: "
                        f"write fxcoalesce.{entry}(fxcoalesce.Config({args}))")
    env_timeout()  # FXCOALESCE_AGREE_TIMEOUT: a bad value is an error now, not ignored
    return config or Config()


def backend(config: Config | None = None, *, on_graph: Callable | None = None,
            mode: str | None = None, options: dict | None = None):
    """A ``torch.compile`` backend: dynamo → AOTAutograd → fxcoalesce passes → codegen.

    With ``codegen="inductor"`` the passes run inside Inductor's ``inner_compile``, on the
    ATen graph before Inductor's own post-grad passes; ``mode`` and ``options`` are
    torch.compile's and reach Inductor as they would with ``backend="inductor"`` (CUDA graphs
    with ``mode="reduce-overhead"``); torch.compile's own ``mode=`` / ``options=`` arguments
    are accepted too. ``codegen="eager"`` runs the rewritten graph as Python (for debugging).
    Where the passes could change a graph's collective sequence, the ranks agree on it at
    compile time through the process group's store, never with a collective, and fall back
    together where they differ (``agreement``). Compiles are
    cached by Inductor, keyed on the pass sources and the config (``compile_cache``);
    ``on_graph(before, after, report)``, called for every graph the passes rewrite (inspection
    tools use it), and ``Config.dump_dir`` need the graphs, so they skip AOTAutograd's cache.
    ``FXCOALESCE_DUMP=dir`` in the environment sets ``Config.dump_dir`` when ``config`` has
    none. Since torch 2.14 (where they keep KV-cache writes in order) Inductor's comm
    reordering passes run after the fxcoalesce passes: they hide compute the schedule pass
    leaves exposed (kimi-k2-tiny verify, torch 2.15: 7 kernels under its 9 all_reduces, none
    without; benchmarks/NOTES.md) and keep the collectives' order
    (tests/test_overlap_order.py); ``options={"reorder_for_compute_comm_overlap": False}``
    turns them off.
    """
    from fxcoalesce.passes import check_config

    from .ranks.agreement import announce
    from .ranks.hooks import watch_dynamo

    announce()  # where this rank runs: peers see at once if it dies before compiling
    watch_dynamo()  # a frame Dynamo skips before any graph compiles is heard too
    cfg = _with_env_dump(_checked(config))
    check_config(cfg)
    if config is None or config.cost == Config().cost:
        cfg = _with_env_profile(cfg)
    base = {**(comm_reorder_options() if cfg.codegen == "inductor" else {}),
            **inductor_patches(mode, options, cfg.codegen)}
    check_ranks = cfg.check_ranks or env_flag(CHECK_RANKS_ENV)

    def compile_graph(gm, example_inputs, *, mode=None, options=None):
        check_torch()  # a torch newer than tested: warn once, run the canaries (torch_internals)
        patches = {**base, **inductor_patches(mode, options, cfg.codegen)}
        try:
            job = GraphCompile(gm, example_inputs, patches, cfg, name=next_graph_name(),
                               on_graph=on_graph)
            return job.run(check_ranks)
        except CollectiveMismatchError as e:
            # raised here, Dynamo would hand the user a BackendCompilerFailed: the graph
            # raises it when called, as the agreement's own errors do
            return _raiser(e)

    return compile_graph


def _with_env_profile(cfg: Config) -> Config:
    """``cfg`` with the cost profile named by ``FXCOALESCE_PROFILE``, if one is set. Not asked
    for in code, so a problem with it is a warning and the default model, not an error."""
    from .config import CostModel, ProfileError

    path = os.environ.get(PROFILE_ENV)
    if not path:
        return cfg
    try:
        return replace(cfg, cost=CostModel.from_profile(path))
    except ProfileError as e:
        log.warning("%s=%s ignored, using the default cost model: %s", PROFILE_ENV, path, e)
        return cfg


def fxcoalesce_backend(gm, example_inputs, **kwargs):
    """The backend registered as ``"fxcoalesce"`` (entry point ``torch_dynamo_backends``,
    through ``fxcoalesce.registered``); torch.compile hands it ``mode=`` / ``options=`` when
    the user gives them."""
    return backend()(gm, example_inputs, **kwargs)


def replace_graph(dst: Graph, src: Graph) -> None:
    """Make ``dst`` hold a copy of ``src`` (Inductor hands custom passes a graph to mutate)."""
    meta = copy.copy(dst.output_node().meta)  # Inductor's facts about the outputs
    for n in reversed(list(dst.nodes)):
        dst.erase_node(n)
    dst.output(dst.graph_copy(src, {})).meta = meta


class FxCoalescePass(CustomGraphPass):
    """The pipeline as ``torch._inductor.config.post_grad_custom_post_pass``.

    Inductor runs it at compile time on every rank; where the passes could change a graph's
    collective sequence the ranks agree on it right there, through the store, as the backend
    does (``agreement``). While a process group of several real ranks is up ``uuid()`` is
    None, so Inductor caches none of the graphs it compiles with this pass (a rank served
    from its cache would never publish the proposal its peers wait for; they would wait the
    whole ``agree_timeout_s`` and fall back: correct, but slow. The backend caches safely:
    use it for cached compiles). Without such a group (one process, or a fake group)
    ``uuid()`` hashes the pass sources and the config. ``check_ranks`` (or
    ``FXCOALESCE_CHECK_RANKS=1``) turns a difference into :class:`CollectiveMismatchError`,
    raised while the graph compiles, before any of its collectives runs.
    """

    def __init__(self, config: Config | None = None):
        from fxcoalesce.passes import check_config

        from .ranks.agreement import announce
        from .ranks.hooks import watch_dynamo

        self.config = config or Config()
        check_config(self.config)
        self.check_ranks = self.config.check_ranks or env_flag(CHECK_RANKS_ENV)
        announce()
        watch_dynamo()

    def __call__(self, graph: Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        name = next_graph_name()
        agreed = rewrite_graph(gm, self.config, name, self.check_ranks)
        if agreed.error:
            raise CollectiveMismatchError(
                f"fxcoalesce check_ranks: {name} would issue different collective sequences "
                f"on different ranks: {agreed.error}")
        keep(agreed, self.config, name, gm)
        record(agreed.report)
        if agreed.graph is not gm and not agreed.report.fell_back:
            replace_graph(graph, agreed.graph.graph)

    def uuid(self) -> str | None:
        if _real_peers():
            return None
        return compile_key(source_fingerprint(), repr(self.config), {})


def _real_peers() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"
            and dist.get_world_size() > 1)


def inductor_pass(config: Config | None = None) -> FxCoalescePass:
    """The fxcoalesce pipeline as an Inductor ``CustomGraphPass`` (``FXCOALESCE_DUMP`` as for
    :func:`backend`; a graph served from Inductor's cache skips the pass and is not dumped)."""
    return FxCoalescePass(_with_env_dump(_checked(config, "inductor_pass")))
