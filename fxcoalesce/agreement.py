"""Every rank issues one collective sequence: the ranks compare what they compiled, and fall
back together, step by step, until they agree.

A rank sees its own graph only, and ranks' graphs can differ (a constant one rank adds after
a wait, a branch on the rank that makes one all_reduce read another). Whatever a pass reads
there — the cost model's compute estimates, the adds ``linearity`` sums through, the slice
``slice`` reduces, even which collective depends on which — may differ, and so may the
collective sequence the passes make. So whenever the passes *could* change the sequence
(``passes.changes_sequence`` and at least one all_reduce: facts of the program's own
sequence, the same on every rank), the ranks compare at compile time, and take the first
step of :func:`ladder` on which every rank issues one sequence:

    1. as configured
    2. without the choices that read compute (no cost-model choices, no slice, linearity
       or fuse_norm)
    3. the program's own collective sequence (only sequence-preserving passes: schedule)

Every rank sees the same gathered sequences, so all take the same step. If even step 3
differs, the program itself issues different collectives on different ranks (plain
``torch.compile`` would run it the same way): a warning, and the graph runs as the program
wrote it. ``check_ranks`` turns any difference into :class:`CollectiveMismatchError`.

Assumed: ranks compile each graph together (SPMD: every rank compiles the same graphs in the
same order), and the program's own collective sequence is the same on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import Config
from .rank_check import CollectiveMismatchError, Sequence, has_peers, mismatch

log = logging.getLogger("fxcoalesce")


@dataclass(frozen=True, slots=True)
class Step:
    label: str
    config: Config


def ladder(cfg: Config) -> list[Step]:
    """The configurations ranks try in turn until they agree (each differs from the last)."""
    from fxcoalesce.passes import program_order, without_compute_choices

    steps = [Step("as configured", cfg)]
    for label, c in (("without the choices that read compute", without_compute_choices(cfg)),
                     ("in the program's own collective order", program_order(cfg))):
        last = steps[-1].config
        if (c.enabled_passes, c.slack_aware) != (last.enabled_passes, last.slack_aware):
            steps.append(Step(label, c))
    return steps


def must_compare(program: Sequence, all_reduces: int, cfg: Config, check_ranks: bool) -> bool:
    """Do ranks compare this graph? A function of the program's own sequence and ``cfg``
    only, so every rank answers alike."""
    from fxcoalesce.passes import changes_sequence

    return has_peers(program) and (check_ranks or (all_reduces > 0 and changes_sequence(cfg)))


@dataclass(slots=True)
class Agreement:
    """How the ranks agreed on one graph (``Report.agreement``)."""

    compared: bool = False
    step: str = "as configured"
    differences: list[str] = field(default_factory=list)
    """The difference each rejected step had, first to last."""

    def as_dict(self) -> dict:
        return {"compared": self.compared, "step": self.step, "differences": self.differences}


def agree(graph_name: str, cfg: Config, build: Callable[[Config], tuple[Any, Sequence]], *,
          check_ranks: bool) -> tuple[Any, Agreement]:
    """Build ``cfg``'s graph, compare its sequence across ranks and fall back along
    :func:`ladder` until every rank issues one sequence. ``build(config)`` returns (what was
    built, its collective sequence)."""
    agreement = Agreement(compared=True)
    for i, step in enumerate(steps := ladder(cfg)):
        built, sequence = build(step.config)
        problem = mismatch(sequence)
        if problem is None:
            agreement.step = step.label
            return built, agreement
        if check_ranks:
            raise CollectiveMismatchError(
                f"fxcoalesce check_ranks: {graph_name} would issue different collective "
                f"sequences on the ranks of {problem}. Ranks pair collectives by order, so it "
                "would compute wrong values or hang. Without check_ranks the ranks fall back "
                "together until they agree.")
        agreement.differences.append(problem)
        if i + 1 < len(steps):
            log.warning("fxcoalesce[%s]: ranks would issue different collectives %s (%s); all "
                        "ranks fall back to the passes %s", graph_name, step.label, problem,
                        steps[i + 1].label)
    log.warning("fxcoalesce[%s]: the program itself issues different collectives on different "
                "ranks (%s); it runs as written, as plain torch.compile would run it",
                graph_name, problem)
    agreement.step = steps[-1].label
    return built, agreement
