"""One Dynamo graph through the backend: agree across ranks, compile with the passes, record.

    job = GraphCompile(gm, example_inputs, patches, cfg, name="graph 0", on_graph=None)
    compiled = job.run(check_ranks=False)

Inside Inductor's ``inner_compile`` every ATen graph goes through ``ranks.compile``'s
``rewrite_agreed`` (the pipeline at each step of the agreement's ladder, the ranks' agreement
on one, its tags), and the agreed step's graph goes on to code generation. This module is the
Inductor glue and the caching. Inductor's caches key on the step too (``compile_cache``): a compile
keyed on one step whose ranks agree on another is redone under the other's key, so a cached
entry always holds the code of the step it is keyed on. A build that AOTAutograd's cache
answered without running the passes agrees with the sequences saved beside the cache entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from . import compile_cache
from .config import Config
from .errors import CollectiveMismatchError
from .pipeline import emit_graph, run_pipeline
from .collectives import find_comm_blocks, program_sequence, sequence_after
from .graph_order import pin_order
from .lowering import lowered_bytes, real_tensors, symm_groups, symm_problem
from .ranks.agreement import (PROCESS, agree_graph, cut_at, frame_identity, guard_keys, has_peers,
                              ladder, must_compare, seen)
from .ranks.compile import Agreed, prepared, rewrite_agreed
from .ranks.hooks import Guarded
from .report import Report, record

log = logging.getLogger("fxcoalesce")


def rewrite_graph(gm, cfg: Config, name: str, check_ranks: bool, **agreed) -> Agreed:
    """The pipeline on one ATen graph: at the step the ranks agree on (``ranks.compile``)
    where a pass could change its collective sequence and a real peer exists, else alone."""
    program = program_sequence(gm.graph)
    if must_compare(program, find_comm_blocks(gm.graph).all_reduce_count, cfg, check_ranks):
        return rewrite_agreed(gm, cfg, name, check_ranks, **agreed)
    return _alone(gm, replace(cfg, dump_dir=None), name, program)


def _alone(gm, quiet: Config, name: str, program) -> Agreed:
    """A graph no peer compares: the passes, kept to the program's sequence where they may
    not change it, and symmetric memory prepared here (no peers)."""
    new, report = run_pipeline(gm, quiet, name=name, record=False, emit=False)
    if sequence_after(gm, new, report) != program and has_peers(program):
        if quiet.strict:
            raise RuntimeError(f"fxcoalesce[{name}]: the passes changed the collective "
                               "sequence where none of them may")
        log.warning("fxcoalesce[%s]: the passes changed the collective sequence where none of "
                    "them may; compiling the graph unrewritten", name)
        new, report = run_pipeline(gm, replace(quiet, passes=()), name=name, record=False,
                                   emit=False)
    sequence = sequence_after(gm, new, report)
    if quiet.lower and symm_groups(sequence):
        with real_tensors():
            problem = symm_problem(sequence, lowered_bytes([report]))
        if problem is not None:
            new, report = run_pipeline(gm, replace(quiet, lower=False), name=name,
                                       record=False, emit=False)
            report.warnings.append(f"symmetric memory cannot be used ({problem}); the "
                                   "all_reduces stay on the group's own implementation")
    return Agreed(new, report, program)




def keep(agreed: Agreed, cfg: Config, name: str, gm, on_graph: Callable | None = None
         ) -> Agreed:
    """Emit the graph kept (trace artifacts, dump, the callback)."""
    if cfg.dump_dir and cfg.dump_passes:  # the per-pass graphs of the step kept
        run_pipeline(gm, cfg if agreed.step == 0 else ladder(cfg)[agreed.step].config,
                     name=name, record=False, emit=False)
    emit_graph(cfg, name, gm, agreed.graph, agreed.report)
    if on_graph is not None:
        on_graph(gm, agreed.graph, agreed.report)
    return agreed


class _Redo(Exception):
    """The ranks agreed on another step than the compile is keyed on."""

    def __init__(self, step: int, agreement: dict):
        super().__init__(f"agreed on step {step}")
        self.step, self.agreement = step, agreement


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
        self.check_ranks = False
        self.frame, self.cut, self.guards = frame_identity(), cut_at(), guard_keys()
        seen(PROCESS.cuts, self.frame, self.cut)
        self.agreement: dict | None = None
        """How the ranks agreed, from an attempt redone under the agreed step's key."""

    def run(self, check_ranks: bool) -> Callable:
        self.check_ranks = check_ranks
        step, tried = 0, set()
        while True:
            tried.add(step)
            try:
                compiled, agreed = self.build(step)
                break
            except _Redo as redo:
                if redo.step in tried:  # cannot happen: a decision, once made, stays
                    raise RuntimeError(f"fxcoalesce[{self.name}]: the agreement moved from "
                                       f"step {step} to {redo.step} and back") from None
                step, self.agreement = redo.step, redo.agreement
        self.closed = True  # a graph compiled later (a lazy backward) is not agreed on
        errors = [a.error for a in agreed if a.error]
        if errors:
            return _raiser(CollectiveMismatchError(
                f"fxcoalesce check_ranks: {self.name} would issue different collective "
                f"sequences on different ranks: {errors[0]}. Ranks pair collectives by "
                "order, so it would compute wrong values or hang. Without check_ranks the "
                "ranks fall back together until they agree."))
        for a in agreed:
            record(a.report)
        if any(a.sequences for a in agreed):  # agreed on: checked at every call (ranks.hooks)
            return Guarded(compiled, agreed, self, self.gm)
        return compiled

    def build(self, step: int, *, aot_cache: bool = True) -> tuple[Callable, list[Agreed]]:
        from fxcoalesce.passes import program_order

        agreed: list[Agreed] = []

        def rewrite(graph_module):
            if self.closed:
                new, report = run_pipeline(graph_module, program_order(self.cfg),
                                           name=self.name)
                return new
            a = rewrite_graph(graph_module, self.cfg, self.name, self.check_ranks,
                               frame=self.frame, cut=self.cut, guards=self.guards,
                               agreement=self.agreement)
            if a.error is None and a.step != step and self.cfg.codegen != "eager":
                raise _Redo(a.step, a.report.agreement)  # the caches are keyed on ``step``
            if a.error is None:
                keep(a, self.cfg, self.name, graph_module, self.on_graph)
            agreed.append(a)
            return graph_module if a.error else a.graph

        if self.cfg.codegen == "eager":
            return _eager(rewrite)(self.gm, self.example_inputs), agreed
        key = compile_cache.compile_key(compile_cache.source_fingerprint(),
                                        f"{self.cfg!r}|step {step}", self.patches)
        use_aot_cache = aot_cache and self.aot_cache
        compiled = self._inductor(rewrite, key, use_aot_cache)
        entry_key = compile_cache.entry_key(key, self.gm, self.example_inputs)
        if agreed:  # the passes ran: what a later cache hit needs to know
            if use_aot_cache and not any(a.error for a in agreed):
                compile_cache.save(entry_key, {"graphs": [a.entry() for a in agreed]})
            return compiled, agreed
        entry = compile_cache.load(entry_key)
        if entry is not None and "graphs" in entry:
            return compiled, [self._from_cache(g, step) for g in entry["graphs"]]
        log.info("fxcoalesce[%s]: AOTAutograd's cache answered but no fxcoalesce entry is "
                 "saved beside it; compiling again past that cache", self.name)
        return self.build(step, aot_cache=False)

    def _from_cache(self, saved: dict, step: int) -> Agreed:
        """A graph AOTAutograd's cache served: the ranks agree on its saved sequences."""
        report = Report.from_dict(saved["report"])
        report.cache, report.graph = "hit", self.name
        program = [tuple(x) for x in saved["program"]]
        a = Agreed(None, report, program)
        if saved["sequences"]:  # the graph was agreed on when it was compiled: again now
            a.sequences = [[tuple(x) for x in s] for s in saved["sequences"]]
            a.workspaces = list(saved["workspaces"])
            steps = ladder(self.cfg)
            outcome = agree_graph(self.name, self.cfg, steps, program, a.sequences,
                                  a.workspaces, check_ranks=self.check_ranks, frame=self.frame,
                                  cut=self.cut, guards=self.guards)
            outcome, notes = prepared(outcome, self.cfg, a.sequences, self.name)
            if outcome.error is None and outcome.step != step:
                raise _Redo(outcome.step, outcome.agreement.as_dict())
            a.step, a.error = outcome.step, outcome.error
            a.tagged = bool(report.agreement.get("checks"))
            # the cached code carries the tags it was compiled with (a function of the step)
            outcome.agreement.checks = list(report.agreement.get("checks", []))
            report.agreement = self.agreement or outcome.agreement.as_dict()
            report.warnings += notes
        trace_artifacts_of_hit(report)
        return a

    def _inductor(self, rewrite, key: str, aot_cache: bool):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        from .torch_internals import disabled

        if "inductor-hook" in disabled():  # plain Inductor
            return compile_fx(self.gm, self.example_inputs, config_patches=self.patches)
        pre = self.user_pre_pass
        keyed = compile_cache.KeyedPass(pre, key)

        from fxcoalesce.torch_internals import keep_mutation_renames

        def inner_compile(graph_module, inputs, **kwargs):
            # the FX graph cache keys on the rewritten graph and on ``keyed``
            new = rewrite(graph_module)
            pin_order(new)  # a staggered order (the split pass) kept through Inductor
            # torch < 2.15: Inductor's fusion could drop a read's edge to the in-place
            # collective (or other mutation) it follows, and its peak-memory reordering then
            # ran the read first (torch_releases.keep_mutation_renames; kimi-k2-tiny's verify
            # with tags, logits off by 2.31, and the TP-2 speculative step were this bug)
            with inductor_config.patch(post_grad_custom_pre_pass=keyed), keep_mutation_renames():
                return compile_fx_inner(new, inputs, **kwargs)

        outer = keyed if aot_cache else compile_cache.KeyedPass(pre, None)
        return compile_fx(self.gm, self.example_inputs, inner_compile=inner_compile,
                          config_patches={**self.patches, "post_grad_custom_pre_pass": outer})


def trace_artifacts_of_hit(report: Report) -> None:
    """A cache hit's structured-trace artifact: the saved report (the graphs were not
    traced in this process)."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": "fxcoalesce_report",
                                                      "encoding": "json"},
                     payload_fn=report.to_json)


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
