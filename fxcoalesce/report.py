"""One report per compiled graph: what the pipeline found, did, left alone, and predicts."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

from .analysis import Analysis
from .collectives import group_setup
from .config import CostModel
from .cost import predict

log = logging.getLogger("fxcoalesce")
_REPORTS: list["Report"] = []


@dataclass(slots=True)
class Report:
    """Counts, bytes, buckets, timings and warnings for one graph."""

    graph: str
    world_size: int | None
    all_reduce: dict[str, int] = field(default_factory=dict)
    predicted_comm_us: dict[str, float] = field(default_factory=dict)
    chains: dict[str, int] = field(default_factory=dict)
    buckets: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    """Per candidate group: merged or not, and the predicted exposed µs of each choice."""
    windows: list[dict] = field(default_factory=list)
    passes: list[dict] = field(default_factory=list)
    analysis_ms: float = 0.0
    """The first analysis alone (ms)."""
    total_ms: float = 0.0
    """The whole pipeline call: analyses, graph copy, passes, lint, report (ms)."""
    nodes: dict[str, int] = field(default_factory=dict)
    other_collectives: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    fell_back: bool = False
    verdict: str = ""
    agreement: dict = field(default_factory=dict)
    """How the ranks agreed on this graph's collectives (``agreement.Agreement.as_dict``: its
    fields say whether they compared and which ladder step they took)."""
    cache: str = ""
    """"" when this process ran the passes; "hit" when Inductor's AOTAutograd cache served the
    compiled graph and this report is the one saved beside it when it was compiled."""

    def to_json(self, **extra) -> str:
        return json.dumps({**extra, **self.to_dict()}, indent=2, default=str)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Report:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def summary(self) -> str:
        a = self.all_reduce
        alone = f", {a['left_alone']} left alone" if a.get("left_alone") else ""
        return (f"fxcoalesce[{self.graph}]: all_reduce {a['before']} -> {a['after']} launches "
                f"(lower bound {a['lower_bound']}{alone}), {a['bytes_before']} -> "
                f"{a['bytes_after']} bytes, {len(self.buckets)} bucket(s); {self.verdict}")


def bound_analysis(before: Analysis, after: Analysis) -> Analysis:
    """The analysis whose bound the report gives: ``before``'s, unless all_reduces it had to
    leave alone (an in-place all_reduce of a view, a fence for everything after it) became
    analysable after the passes (the slice pass reduces the view itself) and the rewritten
    graph's bound, left-alone ones included, is lower: then ``before``'s fence was only
    conservative, and ``after``'s is the truer bound."""
    if before.scan.skipped and (after.lower_bound + len(after.scan.skipped)
                                < before.lower_bound + len(before.scan.skipped)):
        return after
    return before


def verdict(before: Analysis, after: Analysis) -> str:
    """One sentence: where the graph stands against its bound, and what was left alone."""
    if before.all_reduce_count == 0:
        return "no all_reduce in this graph"
    parts = []
    b = bound_analysis(before, after)
    bound = b.lower_bound
    if before.analysed_count == 0:
        parts.append("nothing analysed")
    elif b is before and before.analysed_count == bound:
        parts.append("already at its bound: the all_reduces form dependency chains, and no "
                     "exact rewrite can merge links of a chain")
    elif after.analysed_count <= bound:
        parts.append("reached the lower bound")
    else:
        parts.append(f"{after.analysed_count - bound} launch(es) above the bound "
                     "(bucket cap or interlocked keys; see warnings)")
    if b.scan.skipped:
        reasons = sorted({why for _, why in b.scan.skipped})
        parts.append(f"{len(b.scan.skipped)} all_reduce(s) left alone and not in the "
                     f"bound ({'; '.join(reasons)})")
    return "; ".join(parts)


def build_report(graph: str, before: Analysis, after: Analysis, *, cost: CostModel,
                 passes: list[dict], buckets: list[dict], decisions: list[dict],
                 warnings: list[str],
                 analysis_ms: float, fell_back: bool) -> Report:
    world, _ = group_setup(before.scan)
    warn = [f"{n.name}: left alone: {why}" for n, why in before.scan.skipped]
    warn += [f"{n.name}: left alone: {why}" for n, why in before.scan.unknown]
    bytes_of = lambda a: sum(i.block.nbytes for i in a.infos)  # noqa: E731
    bound = bound_analysis(before, after)
    return Report(
        graph=graph, world_size=world,
        all_reduce={"before": before.all_reduce_count, "after": after.all_reduce_count,
                    "lower_bound": bound.lower_bound,
                    "left_alone": len(bound.scan.skipped),
                    "bytes_before": bytes_of(before), "bytes_after": bytes_of(after)},
        predicted_comm_us={"before": predict(before, cost, world or 2),
                           "after": predict(after, cost, world or 2),
                           "world_size_assumed": world or 2,
                           "model": cost.profile.source if cost.profile else "default"},
        chains={str(k): v for k, v in bound.chains.items()},
        buckets=buckets, decisions=decisions,
        windows=[{"node": i.block.collective.name, "level": i.level, "ready": i.ready,
                  "need": i.need, "slack": i.slack, "bytes": i.block.nbytes,
                  "symbolic": i.block.symbolic}
                 for i in before.infos],
        passes=passes, analysis_ms=round(analysis_ms, 3),
        nodes={"before": len(before.order), "after": len(after.order)},
        other_collectives=dict(before.scan.other),
        warnings=warn + warnings, fell_back=fell_back, verdict=verdict(before, after),
    )


def record(report: Report) -> None:
    _REPORTS.append(report)
    log.info(report.summary())
    for w in report.warnings:
        log.warning("fxcoalesce[%s]: %s", report.graph, w)


class ReportList(list):
    """A list of reports that says why it is empty when indexed."""

    def __getitem__(self, i):
        if not self:
            raise IndexError(
                "no fxcoalesce report recorded in this process: nothing was compiled through "
                "fxcoalesce yet (torch.compile is lazy: call the compiled function first), or "
                "Inductor's FX graph cache served the graph, which skips the inductor_pass() "
                "route's pass when no process group of several ranks is up (the backend "
                "records a report for a cache hit too)")
        return super().__getitem__(i)


def reports() -> ReportList:
    """All reports of this process, oldest first."""
    return ReportList(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()
