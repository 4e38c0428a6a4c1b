"""torch.compile entry points: the ``fxcoalesce`` backend and the Inductor custom pass.

    torch.compile(fn, backend="fxcoalesce", mode="reduce-overhead")
    torch.compile(fn, backend=fxcoalesce.backend(fxcoalesce.Config(bucket_cap_mb=64)))
    torch._inductor.config.post_grad_custom_post_pass = fxcoalesce.inductor_pass()
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from .collectives import issue_sequence
from .config import Config
from .pipeline import next_graph_name, run_pipeline
from .rank_check import checked, has_peers

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
    """``cfg`` with ``dump_dir`` from ``FXCOALESCE_DUMP`` when it sets none itself."""
    if cfg.dump_dir is None and os.environ.get(DUMP_ENV):
        return replace(cfg, dump_dir=os.environ[DUMP_ENV])
    return cfg


def backend(config: Config | None = None, *, on_graph: Callable | None = None,
            mode: str | None = None, options: dict | None = None):
    """A ``torch.compile`` backend: dynamo → AOTAutograd → fxcoalesce passes → codegen.

    With ``codegen="inductor"`` the passes run inside Inductor's ``inner_compile``, on the
    ATen graph before Inductor's own post-grad passes; ``mode`` and ``options`` are
    torch.compile's and reach Inductor as they would with ``backend="inductor"`` (CUDA graphs
    with ``mode="reduce-overhead"``); torch.compile's own ``mode=`` / ``options=`` arguments
    are accepted too. ``codegen="eager"`` runs the rewritten graph as Python (for debugging).
    ``on_graph(before, after, report)`` is called for every graph (inspection tools use it).
    ``FXCOALESCE_DUMP=dir`` in the environment sets ``Config.dump_dir`` when ``config`` has
    none.
    """
    from fxcoalesce.passes import check_config, rank_invariant

    cfg = _with_env_dump(config or Config())
    check_config(cfg)
    if config is None or config.cost == Config().cost:
        cfg = _with_env_profile(cfg)
    base = inductor_patches(mode, options, cfg.codegen)
    check_ranks = cfg.check_ranks or env_flag(CHECK_RANKS_ENV)

    def compile_graph(gm, example_inputs, *, mode=None, options=None):
        patches = {**base, **inductor_patches(mode, options, cfg.codegen)}
        name = next_graph_name()

        def build(config: Config):
            sequences, reports = [], []

            def rewrite(graph_module):
                new, report = run_pipeline(graph_module, config, name=name)
                sequences.append(issue_sequence(new.graph))
                reports.append(report)
                if on_graph is not None:
                    on_graph(graph_module, new, report)
                return new

            return _codegen(gm, example_inputs, rewrite, config, patches), sequences, reports

        compiled, sequences, reports = build(cfg)
        if not reports:  # the rewrite was never called: some cache served the graph
            raise RuntimeError(
                f"fxcoalesce: {name} was compiled without the fxcoalesce passes (a compile "
                "cache answered before they ran; TORCHINDUCTOR_FORCE_DISABLE_CACHES=0 in the "
                "environment?). Unset it, or use fxcoalesce.inductor_pass(), which caches "
                "safely.")
        local = any(r.local_decisions for r in reports) and has_peers(sequences)
        if not (check_ranks or local):
            return compiled
        # choices that read this rank's compute are agreed on at the first call; if ranks
        # differ, all of them fall back to merging every group (rank-invariant by itself).
        # Every checking rank must take the same steps: one without local choices keeps its
        # graph as the fallback, and still joins the second comparison.
        def fallback():
            return build(rank_invariant(cfg))[:2] if local else (compiled, sequences)

        return checked(compiled, name, sequences, fallback=fallback)

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
        log.warning("fxcoalesce: %s=%s ignored, using the default cost model: %s",
                    PROFILE_ENV, path, e)
        return cfg


def _codegen(gm, example_inputs, rewrite, cfg: Config, patches: dict):
    """Compile ``gm`` with ``rewrite`` applied to its ATen graph (Inductor or eager)."""
    if cfg.codegen == "eager":
        return _eager(rewrite)(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph_module, inputs, **kwargs):
        return compile_fx_inner(rewrite(graph_module), inputs, **kwargs)

    # Inductor's caches key on its config, not on inner_compile: a hit would skip the
    # pipeline (and its report), or serve a graph compiled without it (AOTAutograd's cache
    # returned plain Inductor's code for the same graph). Keep them off here;
    # ``inductor_pass`` is the cache-friendly route (its uuid() joins the cache key).
    # ``force_disable_caches``, not the caches' own flags: TORCHINDUCTOR_AUTOGRAD_CACHE=1 /
    # TORCHINDUCTOR_FX_GRAPH_CACHE=1 in the environment override a patch of those.
    with torch.compiler.config.patch(force_disable_caches=True):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                          config_patches=patches or None)


def _eager(rewrite):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw_compiler(gm, example_inputs):
        return make_boxed_func(rewrite(gm).forward)

    return aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table())


def fxcoalesce_backend(gm, example_inputs, **kwargs):
    """The backend registered as ``"fxcoalesce"`` (entry point ``torch_dynamo_backends``);
    torch.compile hands it ``mode=`` / ``options=`` when the user gives them."""
    return backend()(gm, example_inputs, **kwargs)


def source_files() -> list[Path]:
    """The files whose text defines what the passes do (core and passes)."""
    import fxcoalesce.passes as passes

    roots = [Path(__file__).parent, Path(passes.__file__).parent]
    return sorted(p for root in roots for p in root.glob("*.py"))


def source_fingerprint(files: list[Path] | None = None) -> str:
    h = hashlib.sha256()
    for p in files if files is not None else source_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def replace_graph(dst: Graph, src: Graph) -> None:
    """Make ``dst`` hold a copy of ``src`` (Inductor hands custom passes a graph to mutate)."""
    meta = copy.copy(dst.output_node().meta)  # Inductor's facts about the outputs
    for n in reversed(list(dst.nodes)):
        dst.erase_node(n)
    dst.output(dst.graph_copy(src, {})).meta = meta


class FxCoalescePass(CustomGraphPass):
    """The pipeline as ``torch._inductor.config.post_grad_custom_post_pass``.

    ``uuid()`` keys Inductor's FX graph cache: it hashes the pass sources and the config, so
    it changes when either does and is stable otherwise. On a cache hit the pass does not run
    and records no report (``fxcoalesce.reports()`` says so when it is empty).
    """

    def __init__(self, config: Config | None = None):
        from fxcoalesce.passes import check_config, rank_invariant

        # Inductor calls this pass once per rank with no chance to agree across ranks, so
        # choices must not read compute estimates, nor rest on unchecked facts (slice)
        self.config = rank_invariant(config or Config())
        check_config(self.config)
        if self.config.check_ranks:
            raise ValueError("Config(check_ranks=True) needs the fxcoalesce backend "
                             "(torch.compile(..., backend=fxcoalesce.backend(cfg))): a custom "
                             "Inductor pass cannot wrap the compiled graph's first call")

    def __call__(self, graph: Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        new, report = run_pipeline(gm, self.config)
        if new is not gm and not report.fell_back:
            replace_graph(graph, new.graph)

    def uuid(self) -> str:
        return hashlib.sha256(f"{source_fingerprint()}|{self.config!r}".encode()).hexdigest()


def inductor_pass(config: Config | None = None) -> FxCoalescePass:
    """The fxcoalesce pipeline as an Inductor ``CustomGraphPass`` (``FXCOALESCE_DUMP`` as for
    :func:`backend`; a graph served from Inductor's cache skips the pass and is not dumped)."""
    return FxCoalescePass(_with_env_dump(config or Config()))
