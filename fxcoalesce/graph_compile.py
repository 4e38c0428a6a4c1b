"""One Dynamo graph through the backend: agree across ranks, compile with the passes, record.

    job = GraphCompile(gm, example_inputs, patches, cfg, name="graph 0", on_graph=None)
    compiled = job.run(check_ranks=False)

Inside Inductor's ``inner_compile`` every ATen graph goes through :func:`rewrite_agreed`: the
pipeline runs once per step of the agreement's ladder (the FX passes only, milliseconds),
the ranks agree on a step through the store (``exchange``), and the agreed step's graph goes
on to code generation. Inductor's caches key on the step too (``compile_cache``): a compile
keyed on one step whose ranks agree on another is redone under the other's key, so a cached
entry always holds the code of the step it is keyed on. A build that AOTAutograd's cache
answered without running the passes agrees with the sequences saved beside the cache entry.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import compile_cache
from .ranks.agreement import ladder, must_compare
from .collectives import find_comm_blocks, program_sequence, sequence_after
from .collectives import group_of as group_of_node
from .config import Config
from .ranks.exchange import (CUTS, Outcome, agree_graph, cut_at, frame_identity, guard_keys, seen,
                       without_symm)
from .lowering import lowered_bytes, symm_problem
from .pipeline import emit_graph, run_pipeline
from .ranks.check import CollectiveMismatchError, Sequence, has_peers
from .report import Report, explain_agreement, record
from .ranks.runtime import Guarded

log = logging.getLogger("fxcoalesce")


@dataclass(slots=True)
class Agreed:
    """One ATen graph after the agreement: the graph to compile, its report, and what a
    later cache hit needs to agree again (the program's and every step's sequence)."""

    graph: object
    report: Report
    program: Sequence = field(default_factory=list)
    sequences: list[Sequence] = field(default_factory=list)
    workspaces: list[int] = field(default_factory=list)
    step: int = 0
    error: str | None = None
    tagged: bool = False
    """The graph carries run-time tags (``ranks.tag``)."""

    def entry(self) -> dict:
        return {"program": self.program, "sequences": self.sequences,
                "workspaces": self.workspaces, "step": self.step,
                "report": self.report.to_dict()}


@contextlib.contextmanager
def _real_tensors():
    """Real tensors even inside a compile's fake mode (symmetric memory is allocated here)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        yield


def prepared(outcome: Outcome, cfg: Config, sequences: list[Sequence], name: str
             ) -> tuple[Outcome, list[str]]:
    """Prepare symmetric memory for the agreed step if it uses some (a collective set-up,
    run only where every rank of the decision is at this compile: ``outcome.fresh``); on
    failure, which every rank sees alike, the step without symmetric memory."""
    from .lowering import symm_groups

    if outcome.error or not cfg.lower or not symm_groups(sequences[outcome.step]):
        return outcome, []
    if not outcome.fresh:  # prepared when the ranks agreed on this graph, in this process
        return outcome, []
    with _real_tensors():
        problem = symm_problem(sequences[outcome.step], outcome.ws)
    if problem is None:
        return outcome, []
    note = (f"symmetric memory cannot be used ({problem}); every rank compiles the step "
            "without it")
    log.warning("fxcoalesce[%s]: %s", name, note)
    return without_symm(outcome), [note]


def rewrite_agreed(gm, cfg: Config, name: str, check_ranks: bool, *,
                   frame: str | None = None, cut: str | None = None,
                   guards: list[str] | None = None, agreement: dict | None = None) -> Agreed:
    """The pipeline on ``gm`` at the step the ranks agree on (no agreement where no pass
    could change the sequence or no real peer exists). ``agreement``: what the report says
    of it, where an earlier attempt of this compile agreed (and this one read the decision)."""
    program = program_sequence(gm.graph)
    quiet = replace(cfg, dump_dir=None)
    if not must_compare(program, find_comm_blocks(gm.graph).all_reduce_count, cfg,
                        check_ranks):
        new, report = run_pipeline(gm, quiet, name=name, record=False, emit=False)
        if sequence_after(gm, new, report) != program and has_peers(program):
            if cfg.strict:
                raise RuntimeError(f"fxcoalesce[{name}]: the passes changed the collective "
                                   "sequence where none of them may")
            log.warning("fxcoalesce[%s]: the passes changed the collective sequence where "
                        "none of them may; compiling the graph unrewritten", name)
            new, report = run_pipeline(gm, replace(quiet, passes=()), name=name, record=False,
                                       emit=False)
        sequence = sequence_after(gm, new, report)
        if cfg.lower and _symm(sequence):  # no peers (else compared): a local set-up
            with _real_tensors():
                problem = symm_problem(sequence, lowered_bytes([report]))
            if problem is not None:
                new, report = run_pipeline(gm, replace(quiet, lower=False), name=name,
                                           record=False, emit=False)
                report.warnings.append(f"symmetric memory cannot be used ({problem}); the "
                                       "all_reduces stay on the group's own implementation")
        return Agreed(new, report, program)
    t0 = time.perf_counter()
    steps, built = ladder_runs(gm, cfg, name, program)
    sequences = [b[2] for b in built]
    workspaces = [b[3] for b in built]
    t1 = time.perf_counter()
    outcome = agree_graph(name, cfg, steps, program, sequences, workspaces,
                          check_ranks=check_ranks,
                          frame=frame_identity() if frame is None else frame,
                          cut=cut_at() if frame is None else cut,
                          guards=guard_keys() if frame is None else guards)
    outcome, notes = prepared(outcome, cfg, sequences, name)
    new, report = built[outcome.step][:2]
    if new is None:  # the program's own order, built only when it is the step kept
        new, report = run_pipeline(gm, replace(steps[-1].config, dump_dir=None),
                                   name=name, record=False, emit=False)
    if outcome.error is None and cfg.run_checks:
        new = tagged(gm, new, outcome, name,
                     frame=frame if frame is not None else frame_identity())
    # what agreeing added to this compile: the pipeline at the other steps, the exchange
    first_ms = (built[0][1].total_ms or 0.0) if built[0][1] is not None else 0.0
    report.agreement = {**outcome.agreement.as_dict(),
                        "ladder_ms": round((t1 - t0) * 1e3 - first_ms, 3),
                        "exchange_ms": round((time.perf_counter() - t1) * 1e3, 3)}
    if agreement is not None:
        report.agreement = agreement
    report.warnings += notes
    explain_agreement(report)
    return Agreed(new, report, program, sequences, workspaces, outcome.step, outcome.error,
                  tagged=bool(report.agreement.get("checks")))


def ladder_runs(gm, cfg: Config, name: str, program: Sequence) -> tuple[list, list[tuple]]:
    """(the ladder of ``cfg``, per step (graph, report, sequence, workspace bytes)): the
    pipeline at every step whose sequence can differ from the steps already run. A copy
    without symmetric memory of a step that uses none is that step; the program's own order
    issues the program's sequence by construction (its graph is built only if kept: None),
    and so does a step whose first all_reduce could not carry its run-time tag against the
    program's (``ranks.tag.compatible``)."""
    from fxcoalesce.ranks.tag import compatible

    steps = ladder(cfg)
    built: list[tuple] = []
    for i, step in enumerate(steps):
        if step.without_symm and not _symm(built[-1][2]):
            built.append(built[-1])  # no symmetric memory to leave out: the same graph
        elif i == len(steps) - 1 and i > 0:
            built.append((None, None, program, 0))
        else:
            new, report = run_pipeline(gm, replace(step.config, dump_dir=None), name=name,
                                       record=False, emit=False)
            sequence = sequence_after(gm, new, report)
            why = compatible(gm, new) if cfg.run_checks and sequence != program else None
            if why is not None:
                log.info("fxcoalesce[%s]: step %r issues the program's own sequence: %s",
                         name, step.label, why)
                new, report, sequence = None, None, program
            built.append((new, report, sequence, lowered_bytes([report]) if report else 0))
    return steps, built


def tagged(gm, new, outcome: Outcome, name: str, world: Callable | None = None,
           frame: str = ""):
    """``new`` with its run-time tag (``ranks.tag``) where the decision says so
    (``outcome.tagged``: a rewritten graph, or a re-cut or recompile of a function a rank
    rewrote), else ``new`` as it is. ``world(group name)``: a group's size (by default the
    process group's)."""
    from fxcoalesce.ranks.tag import tag_pass

    from .collectives import group_of
    from .pipeline import copy_graph_module
    from .ranks.check import _resolve

    if not (outcome.tagged and outcome.tag):
        return new
    size = world or (lambda g: _resolve(g).size())
    if new is gm:
        new = copy_graph_module(gm)
    lines = tag_pass(new, outcome.tag, world=lambda n: size(group_of(n)), where=name)
    outcome.agreement.checks = lines
    return new


def checks_of(gm) -> list[tuple]:
    """The checked all_reduces of a tagged graph ``gm``, in issue order, while each is its
    group's first collective there: (group, op, dtype, elements with the tag: an int, or a
    SymInt of the frame's inputs, device). What a rank that must stop while its peers run
    ``gm`` sends them (``runtime``): past a group whose first collective is not checked,
    no stand-in pairs with what the peers issue."""
    from fxcoalesce.collectives import is_collective
    from fxcoalesce.meta import tensor_val
    from fxcoalesce.ranks.tag import CHECKED

    seen, entries = set(), []
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        group = group_of_node(n)
        first = group not in seen
        seen.add(group)
        if n.meta.get(CHECKED) is None:
            continue
        val = tensor_val(n.args[0])
        if val is None or not first:
            break
        entries.append((group, str(n.args[1]), val.dtype, val.numel(), str(val.device)))
    return entries


STAND_IN_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                  "reduce_scatter_tensor": "reduce_scatter"}
"""The collectives a rank that stops can stand in for with zeros (:func:`stand_ins_of`)."""


def stand_ins_of(gm, world: frozenset[int] | None) -> list[tuple] | None:
    """What a rank that stops sends before a tagged graph ``gm``'s checks: the collectives
    it issues before its first checked all_reduce, as (kind, group, op, dtype, elements,
    device), zeros in each. Its peers sit in them (an all_gather first on a group: fuzz
    seed 90026) and then reach the check that fails. Sound only where that check's group
    is every rank of the ``world``: each rank holding a value built on the zeros fails that
    check, or waits before it, and none returns one. None where the graph opens with such
    collectives and they cannot be stood in for (that check on a smaller group: fuzz seed
    110178; another kind; no check): the peers sit there, a poison sent to a later check
    would wait for them until the group's timeout, so nothing is sent; they hear of the
    stop from the store and their collective fails as this rank's process ends."""
    from fxcoalesce.collectives import is_collective, op_name
    from fxcoalesce.meta import tensor_val
    from fxcoalesce.ranks.tag import CHECKED, group_members

    out = []
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        group, val = group_of_node(n), tensor_val(n.args[0])
        if n.meta.get(CHECKED) is not None:
            return out if not out or (world is not None
                                      and group_members(group) == world) else None
        kind = STAND_IN_KINDS.get(op_name(n))
        if kind is None or val is None or group is None:
            return None
        op = str(n.args[1]) if kind != "all_gather" else ""
        out.append((kind, group, op, val.dtype, val.numel(), str(val.device)))
    return None if out else []


OPENS: dict = {}
"""Frame -> its tagged graphs on this rank (``runtime.Guarded``, the latest last): a frame
here has run a tagged graph on this rank."""


def _symm(sequence: Sequence) -> bool:
    from .lowering import symm_groups

    return bool(symm_groups(sequence))


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
        seen(CUTS, self.frame, self.cut)
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
        if any(a.sequences for a in agreed):  # agreed on: checked at every call (runtime)
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
            a = rewrite_agreed(graph_module, self.cfg, self.name, self.check_ranks,
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

        pre = self.user_pre_pass
        keyed = compile_cache.KeyedPass(pre, key)

        from fxcoalesce.torch_releases import keep_mutation_renames

        def inner_compile(graph_module, inputs, **kwargs):
            # the FX graph cache keys on the rewritten graph and on ``keyed``
            new = rewrite(graph_module)
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
