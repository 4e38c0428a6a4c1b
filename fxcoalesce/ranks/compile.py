"""One ATen graph through the agreement: the pipeline at every ladder step, the step the ranks
agree on, symmetric memory prepared for it, its tags. ``graph_compile`` calls
:func:`rewrite_agreed` inside Inductor's ``inner_compile`` and compiles what it returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..collectives import group_of, program_sequence, sequence_after
from ..config import Config
from ..lowering import lowered_bytes, real_tensors, symm_groups, symm_problem
from ..pipeline import copy_graph_module, run_pipeline
from ..report import Report, explain_agreement
from .agreement import (Outcome, Sequence, agree_graph, cut_at, frame_identity, guard_keys,
                        in_program_order, ladder, resolve)
from .tag import tag_pass

log = logging.getLogger("fxcoalesce")


@dataclass(slots=True)
class Agreed:
    """One ATen graph after the agreement, and what a later cache hit needs to agree again."""

    graph: object
    report: Report
    program: Sequence = field(default_factory=list)
    sequences: list[Sequence] = field(default_factory=list)
    workspaces: list[int] = field(default_factory=list)
    step: int = 0
    error: str | None = None
    tagged: bool = False

    def entry(self) -> dict:
        return {"program": self.program, "sequences": self.sequences,
                "workspaces": self.workspaces, "step": self.step,
                "report": self.report.to_dict()}


def prepared(outcome: Outcome, cfg: Config, sequences: list[Sequence], name: str
             ) -> tuple[Outcome, list[str]]:
    """Prepare symmetric memory for the agreed step if it uses some (run only where every
    rank of the decision is at this compile: ``outcome.fresh``); on failure, which every rank
    sees alike, the program's own order."""
    if outcome.error or not cfg.lower or not symm_groups(sequences[outcome.step]):
        return outcome, []
    if not outcome.fresh:  # prepared when the ranks agreed on this graph, in this process
        return outcome, []
    with real_tensors():
        problem = symm_problem(sequences[outcome.step], outcome.ws)
    if problem is None:
        return outcome, []
    note = (f"symmetric memory cannot be used ({problem}); every rank compiles the program's "
            "own order")
    log.warning("fxcoalesce[%s]: %s", name, note)
    return in_program_order(outcome), [note]


def rewrite_agreed(gm, cfg: Config, name: str, check_ranks: bool, *,
                   frame: str | None = None, cut: str | None = None,
                   guards: list[str] | None = None, agreement: dict | None = None) -> Agreed:
    """The pipeline on ``gm`` at the step the ranks agree on (``graph_compile`` calls it where a
    pass could change the sequence and a real peer exists); ``agreement``: an earlier try's."""
    program = program_sequence(gm.graph)
    t0 = time.perf_counter()
    steps, built = ladder_runs(gm, cfg, name, program)
    sequences, workspaces = [b[2] for b in built], [b[3] for b in built]
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
        new = tagged(gm, new, outcome, name)
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
    pipeline at every step whose sequence can differ from the steps already run. The
    program's own order issues the program's sequence (its graph built only if kept: None).
    Every pass keeps the first all_reduce a tag rides on (``checked.pinned``; pinned by
    ``tests/test_property_ranks.py``), so a rewrite's tag pairs with the program's."""
    steps = ladder(cfg)
    built: list[tuple] = []
    for i, step in enumerate(steps):
        if i == len(steps) - 1 and i > 0:
            built.append((None, None, program, 0))
        else:
            new, report = run_pipeline(gm, replace(step.config, dump_dir=None), name=name,
                                       record=False, emit=False)
            sequence = sequence_after(gm, new, report)
            built.append((new, report, sequence, lowered_bytes([report]) if report else 0))
    return steps, built


def tagged(gm, new, outcome: Outcome, name: str, world: Callable | None = None):
    """``new``, tagged where the decision says so; ``world(group)``: a group's size."""
    if not (outcome.tagged and outcome.tag):
        return new
    size = world or (lambda g: resolve(g).size())
    if new is gm:
        new = copy_graph_module(gm)
    outcome.agreement.checks = tag_pass(new, outcome.tag, world=lambda n: size(group_of(n)),
                                        where=name)
    return new
