"""One Dynamo graph through the backend: compile with the passes, agree across ranks, record.

    job = GraphCompile(gm, example_inputs, patches, cfg, name="graph 0", on_graph=None)
    compiled = job.run(check_ranks=False)

``build(config)`` compiles the graph once (Inductor or eager) with the passes of ``config``
inside ``inner_compile`` and returns a :class:`Built`: the compiled callable, the collective
sequences before and after the passes, and the reports. A build that Inductor's AOTAutograd
cache answered without running the passes takes those facts from the entry saved beside the
cache (``compile_cache``), or, without one, compiles again past that cache. ``run`` builds
``cfg``, lets ``agreement`` compare and fall back if the passes could change the sequence,
and records the reports of the build it keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import compile_cache
from .agreement import Agreement, agree, must_compare
from .collectives import find_comm_blocks, program_sequence, sequence_after
from .config import Config
from .lowering import lowered_bytes, symm_problem
from .pipeline import run_pipeline
from .rank_check import CollectiveMismatchError, Sequence, has_peers
from .report import Report, record

log = logging.getLogger("fxcoalesce")


@dataclass(slots=True)
class Built:
    compiled: Callable
    program: Sequence = field(default_factory=list)
    """The collectives of the graphs the passes were given (every inner graph, in order)."""
    sequence: Sequence = field(default_factory=list)
    """The collectives of the rewritten graphs."""
    all_reduces: int = 0
    reports: list[Report] = field(default_factory=list)

    def entry(self) -> dict:
        return {"program": self.program, "sequence": self.sequence,
                "all_reduces": self.all_reduces, "reports": [r.to_dict() for r in self.reports]}

    @classmethod
    def from_entry(cls, compiled, entry: dict) -> Built:
        reports = [Report.from_dict(r) for r in entry["reports"]]
        for r in reports:
            r.cache = "hit"
        return cls(compiled, [tuple(x) for x in entry["program"]],
                   [tuple(x) for x in entry["sequence"]], entry["all_reduces"], reports)


class GraphCompile:
    def __init__(self, gm, example_inputs, patches: dict, cfg: Config, *, name: str,
                 on_graph: Callable | None = None):
        from torch._inductor import config as inductor_config

        self.gm, self.example_inputs, self.patches, self.cfg = gm, example_inputs, patches, cfg
        self.name, self.on_graph = name, on_graph
        self.user_pre_pass = patches.get("post_grad_custom_pre_pass",
                                         inductor_config.post_grad_custom_pre_pass)
        # the graphs are wanted (callback, dump): AOTAutograd must run, never its cache
        self.aot_cache = on_graph is None and cfg.dump_dir is None
        self.closed = False

    def run(self, check_ranks: bool) -> Callable:
        cfg, notes = self.cfg, []
        while True:
            try:
                chosen, agreement = self._agree(cfg, check_ranks)
            except CollectiveMismatchError as e:  # raised at the call, as the user's own code
                return _raiser(e)                 # would, not inside Dynamo's compile
            problem = (symm_problem(chosen.sequence, lowered_bytes(chosen.reports))
                       if cfg.lower else None)
            if problem is None:
                break
            notes.append(f"symmetric memory cannot be used ({problem}); every rank keeps its "
                         "all_reduces on NCCL")
            log.warning("fxcoalesce[%s]: %s", self.name, notes[-1])
            cfg = replace(cfg, lower=False)
        self.closed = True  # a graph compiled later (a lazy backward) cannot be compared
        for r in chosen.reports:
            r.agreement = agreement.as_dict()
            r.warnings += notes
            record(r)
        return chosen.compiled

    def _agree(self, cfg: Config, check_ranks: bool) -> tuple[Built, Agreement]:
        first = self.build(cfg)

        def build(config: Config) -> tuple[Built, Sequence]:
            built = first if config is cfg else self.build(config)
            return built, built.sequence

        if must_compare(first.program, first.all_reduces, cfg, check_ranks):
            return agree(self.name, cfg, build, check_ranks=check_ranks)
        return self._unchanged(first, cfg), Agreement()

    def _unchanged(self, built: Built, cfg: Config) -> Built:
        """``built``, which no rank compares: its passes must have kept the program's
        sequence wherever peers could see it (else a pass broke its promise: not risked)."""
        if built.sequence == built.program or not has_peers(built.program):
            return built
        if cfg.strict:
            raise RuntimeError(f"fxcoalesce[{self.name}]: the passes changed the collective "
                               "sequence where none of them may")
        log.warning("fxcoalesce[%s]: the passes changed the collective sequence where none of "
                    "them may; compiling the graph unrewritten", self.name)
        return self.build(replace(cfg, passes=()))

    def build(self, config: Config, *, aot_cache: bool = True) -> Built:
        from fxcoalesce.passes import program_order

        built = Built(compiled=None)

        def rewrite(graph_module):
            now = program_order(config) if self.closed else config
            new, report = run_pipeline(graph_module, now, name=self.name, record=self.closed)
            built.program += program_sequence(graph_module.graph)
            built.sequence += sequence_after(graph_module, new, report)
            built.all_reduces += find_comm_blocks(graph_module.graph).all_reduce_count
            built.reports.append(report)
            if self.on_graph is not None:
                self.on_graph(graph_module, new, report)
            return new

        if config.codegen == "eager":
            built.compiled = _eager(rewrite)(self.gm, self.example_inputs)
            return built
        key = compile_cache.compile_key(compile_cache.source_fingerprint(), repr(config),
                                        self.patches)
        use_aot_cache = aot_cache and self.aot_cache
        built.compiled = self._inductor(rewrite, key, use_aot_cache)
        entry_key = compile_cache.entry_key(key, self.gm, self.example_inputs)
        if built.reports:  # the passes ran: what a later cache hit needs to know
            if use_aot_cache:
                compile_cache.save(entry_key, built.entry())
            return built
        entry = compile_cache.load(entry_key)
        if entry is not None:
            return Built.from_entry(built.compiled, entry)
        log.info("fxcoalesce[%s]: AOTAutograd's cache answered but no fxcoalesce entry is "
                 "saved beside it; compiling again past that cache", self.name)
        return self.build(config, aot_cache=False)

    def _inductor(self, rewrite, key: str, aot_cache: bool):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        pre = self.user_pre_pass
        keyed = compile_cache.KeyedPass(pre, key)

        def inner_compile(graph_module, inputs, **kwargs):
            # the FX graph cache keys on the rewritten graph and on ``keyed``
            with inductor_config.patch(post_grad_custom_pre_pass=keyed):
                return compile_fx_inner(rewrite(graph_module), inputs, **kwargs)

        outer = keyed if aot_cache else compile_cache.KeyedPass(pre, None)
        return compile_fx(self.gm, self.example_inputs, inner_compile=inner_compile,
                          config_patches={**self.patches, "post_grad_custom_pre_pass": outer})


def _raiser(error: Exception) -> Callable:
    """A compiled graph that raises ``error`` when called: every rank raises before any of
    the graph's collectives runs."""
    def run(*args, **kwargs):
        raise error

    return run


def _eager(rewrite):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw_compiler(gm, example_inputs):
        return make_boxed_func(rewrite(gm).forward)

    return aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table())
