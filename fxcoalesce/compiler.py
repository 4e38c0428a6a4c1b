"""torch.compile entry points: the ``fxcoalesce`` backend and the Inductor custom pass.

    torch.compile(fn, backend="fxcoalesce")
    torch.compile(fn, backend=fxcoalesce.backend(fxcoalesce.Config(bucket_cap_mb=64)))
    torch._inductor.config.post_grad_custom_post_pass = fxcoalesce.inductor_pass()
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from .config import Config
from .pipeline import run_pipeline


def backend(config: Config | None = None, *, on_graph: Callable | None = None):
    """A ``torch.compile`` backend: dynamo → AOTAutograd → fxcoalesce passes → codegen.

    With ``codegen="inductor"`` the passes run inside Inductor's ``inner_compile``, on the
    ATen graph before Inductor's own post-grad passes; ``codegen="eager"`` runs the
    rewritten graph as Python (for debugging). ``on_graph(before, after, report)`` is called
    for every graph (inspection tools use it).
    """
    cfg = config or Config()

    def rewrite(gm):
        new, report = run_pipeline(gm, cfg)
        if on_graph is not None:
            on_graph(gm, new, report)
        return new

    if cfg.codegen == "eager":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        def fw_compiler(gm, example_inputs):
            return make_boxed_func(rewrite(gm).forward)

        return aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table())

    def fxcoalesce_inductor(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph_module, inputs, **kwargs):
            return compile_fx_inner(rewrite(graph_module), inputs, **kwargs)

        # Inductor's caches key on its config, not on inner_compile: a hit would skip the
        # pipeline (and its report), or serve a graph compiled without it. Keep them off here;
        # ``inductor_pass`` is the cache-friendly route (its uuid() joins the cache key).
        with torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    return fxcoalesce_inductor


def fxcoalesce_backend(gm, example_inputs):
    """The backend registered as ``"fxcoalesce"`` (entry point ``torch_dynamo_backends``)."""
    return backend()(gm, example_inputs)


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
    meta = copy.copy(next(iter(reversed(dst.nodes))).meta)  # Inductor's facts about the outputs
    for n in reversed(list(dst.nodes)):
        dst.erase_node(n)
    dst.output(dst.graph_copy(src, {})).meta = meta


class FxCoalescePass(CustomGraphPass):
    """The pipeline as ``torch._inductor.config.post_grad_custom_post_pass``.

    ``uuid()`` keys Inductor's FX graph cache: it hashes the pass sources and the config, so
    it changes when either does and is stable otherwise.
    """

    def __init__(self, config: Config | None = None):
        self.config = config or Config()

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
    """The fxcoalesce pipeline as an Inductor ``CustomGraphPass``."""
    return FxCoalescePass(config)
