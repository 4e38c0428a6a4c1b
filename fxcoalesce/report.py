"""One report per compiled graph: what the pipeline found, did, left alone, and predicts."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field

from .analysis import Analysis
from .collectives import group_setup
from .config import CostModel
from .cost import predict
from .meta import module_path
from .reduce_ops import ADVICE, reduce_op_breaks

log = logging.getLogger("fxcoalesce")
_REPORTS: list["Report"] = []


@dataclass(slots=True)
class Report:
    """Counts, bytes, buckets, timings and warnings for one graph."""

    graph: str
    world_size: int | None
    backend: str | None = None
    """The process group's backend ("nccl", "gloo", "fake"; None when no group resolves)."""
    all_reduce: dict[str, int] = field(default_factory=dict)
    predicted_comm_us: dict[str, float] = field(default_factory=dict)
    chains: dict[str, int] = field(default_factory=dict)
    buckets: list[dict] = field(default_factory=list)
    """Per collective a pass made: its ``members`` (FX names), ``kind`` ("cat": bucketed,
    "sum": summed, ...), and the program's all_reduces behind it: ``originals`` (FX names in
    the graph the pipeline was given) and their ``modules`` (paths, "" where unknown)."""
    decisions: list[dict] = field(default_factory=list)
    """Per candidate group: merged or not, and the predicted exposed µs of each choice;
    ``originals`` and ``modules`` as in ``buckets``. The group's own all_reduce is named
    as the group runs it (:func:`default_impl`: "nccl", "gloo all_reduce")."""
    modules: dict[str, str] = field(default_factory=dict)
    """Module path of each collective of the graph the pipeline was given, by FX name
    (``meta.module_path``; "" where unknown)."""
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

    def pass_cost_ms(self) -> dict[str, float]:
        """What fxcoalesce added to this graph's compile, measured inside it (ms): the
        pipeline (``total_ms``) and, where the ranks compared, agreeing (``agreement``: the
        pipeline at the ladder's other steps, and the exchange through the store, waiting
        for the peers included). The rest of a compile is Dynamo, AOTAutograd and codegen."""
        agreed = self.agreement or {}
        ladder = float(agreed.get("ladder_ms") or 0.0)
        exchange = float(agreed.get("exchange_ms") or 0.0)
        return {"pipeline": self.total_ms, "ladder": ladder, "exchange": exchange,
                "total": round(self.total_ms + ladder + exchange, 3)}

    def summary(self) -> str:
        """One line of counts, then one line per merge (and per group kept apart), naming the
        all_reduces by module path, their FX names beside them."""
        a = self.all_reduce
        alone = f", {a['left_alone']} left alone" if a.get("left_alone") else ""
        kinds: dict[str, int] = {}
        for b in self.buckets:
            word = KIND_COUNTS.get(b.get("kind", "cat"), b.get("kind", "cat"))
            kinds[word] = kinds.get(word, 0) + 1
        did = "".join(f", {n} {word}" for word, n in kinds.items())
        lines = [f"fxcoalesce[{self.graph}]: all_reduce {a['before']} -> {a['after']} launches "
                 f"(lower bound {a['lower_bound']}{alone}), {a['bytes_before']} -> "
                 f"{a['bytes_after']} bytes{did}; {self.verdict}"]
        details = [merge_line(b) for b in self.buckets]
        details += [kept_apart_line(d) for d in self.decisions
                    if d.get("pass") in ("bucket", "linearity") and d["chose"] != "merge all"]
        # a split, or a decline at a size where it could have paid (decode sizes: the JSON)
        details += [d["note"] for d in self.decisions if d.get("pass") == "split"
                    and (d["chose"] != "whole" or d.get("tokens", 0) >= SPLIT_SHOWN_FROM)]
        if len(details) > SUMMARY_LINES:
            more = len(details) - SUMMARY_LINES + 1
            details = details[:SUMMARY_LINES - 1] + [f"... {more} more (report.to_json())"]
        return "\n".join(lines + [f"  {d}" for d in details])


SPLIT_SHOWN_FROM = 32
"""Token count from which :meth:`Report.summary` shows the split pass's decline (``passes.split``
never splits fewer by cost); below, the reason is in ``to_json()``."""

SUMMARY_LINES = 12
"""Most merge lines :meth:`Report.summary` prints; ``to_json()`` has them all."""

KIND_COUNTS = {"cat": "bucketed", "sum": "summed", "slice": "sliced",
               "fused_add_rms_norm": "fused", "one_shot": "lowered", "two_shot": "lowered",
               "split": "split"}
"""A bucket's kind as the summary counts it: "bucketed" only for a concatenation."""

KIND_RESULTS = {"cat": "one all_reduce, bucketed", "sum": "one all_reduce, summed",
                "slice": "an all_reduce of the slice that is read",
                "fused_add_rms_norm": "one kernel with the add + RMSNorm after it",
                "one_shot": "a one-shot all_reduce (symmetric memory)",
                "two_shot": "a two-shot all_reduce (symmetric memory)",
                "split": "an all_reduce of one part of the tokens (token split)"}
"""What a collective a pass made is, by its kind: the right side of a merge line."""


def default_impl(backend: str | None) -> str:
    """The name of a group's own all_reduce, which the passes call "nccl": "nccl" for NCCL
    (and for a fake group or none, which model one), else "<backend> all_reduce"."""
    if not backend or backend == "fake" or "nccl" in backend:
        return "nccl"
    return f"{backend} all_reduce"


def _labels(record: dict) -> str:
    """The program's all_reduces behind a bucket or decision: module paths, else FX names."""
    return " + ".join(m or o for m, o in zip(record.get("modules", ()),
                                             record.get("originals", ())))


def merge_line(bucket: dict) -> str:
    """"blocks.0.attn + blocks.0.mlp -> one all_reduce, summed  [all_reduce + all_reduce_1 ->
    all_reduce_default]": in module paths, the FX names beside them."""
    kind = bucket.get("kind", "cat")
    fx = " + ".join(bucket["members"])
    lhs = _labels(bucket) or fx
    fx = f"{fx} -> {bucket['collective']}" if lhs != fx else bucket["collective"]
    return f"{lhs} -> {KIND_RESULTS.get(kind, kind)}  [{fx}]"


def kept_apart_line(decision: dict) -> str:
    """A group of independent all_reduces the cost model did not merge (or merged in part)."""
    us = decision.get("predicted_exposed_us", {})
    chose = "kept separate" if decision["chose"] == "separate" else decision["chose"]
    fx = " + ".join(decision["members"])
    lhs = _labels(decision) or fx
    return (f"{lhs}: {chose}, predicted exposed {us.get('separate')} µs apart vs "
            f"{us.get('merged')} µs merged" + (f"  [{fx}]" if lhs != fx else ""))


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


def split_taken(decisions: list[dict]) -> list[dict]:
    """The token split's decisions that split (each names its all_reduces in ``members``)."""
    return [d for d in decisions if d.get("pass") == "split" and d["chose"] != "whole"]


def split_line(decisions: list[dict]) -> str | None:
    """What the token split did, in one line: the all_reduces it runs in parts and the
    predicted saving; else, where it could have paid (``SPLIT_SHOWN_FROM`` tokens on), why
    not; None where it had nothing to say."""
    mine = [d for d in decisions if d.get("pass") == "split"]
    split = split_taken(mine)
    if split:
        n = sum(len(d["members"]) for d in split)
        saving = sum(d.get("predicted_us", {}).get("saving", 0.0) for d in split)
        forced = "forced by Config.token_split=True; " if "token_split=True" in \
            split[0]["note"] else ""
        whole = len(mine) - len(split)
        return (f"{n} all_reduce(s) in 2 parts of the {split[0]['tokens']} tokens, each under "
                f"the other part's compute: {forced}predicted {-saving / 1e3:+.3f} ms a step"
                + (f"; {whole} stretch(es) left whole" if whole else ""))
    shown = [d for d in mine if d.get("tokens", 0) >= SPLIT_SHOWN_FROM]
    return f"not split: {shown[0]['note']}" if shown else None


def verdict(before: Analysis, after: Analysis, decisions: list[dict] = ()) -> str:
    """One sentence: where the graph stands against its bound, and what was left alone (and
    the token split's launches above the bound, by design)."""
    if before.all_reduce_count == 0:
        return "no all_reduce in this graph"
    parts = []
    b = bound_analysis(before, after)
    bound = b.lower_bound
    split = sum(len(d["members"]) for d in split_taken(decisions))
    after_n = after.analysed_count - split  # each split all_reduce: one launch more
    if before.analysed_count == 0:
        parts.append("nothing analysed")
    elif b is before and before.analysed_count == bound:
        parts.append("already at its bound: the all_reduces form dependency chains, and no "
                     "exact rewrite can merge links of a chain")
    elif after_n <= bound:
        parts.append("reached the lower bound")
    else:
        parts.append(f"{after_n - bound} launch(es) above the bound "
                     "(the bucket cap, interlocked keys, or the first all_reduce kept apart "
                     "for the run-time check; see warnings)")
    if split:
        parts.append(f"the token split adds {split} launch(es) by design (each of {split} "
                     "all_reduces in 2 parts, under the other part's compute)")
    if b.scan.skipped:
        reasons = sorted({why for _, why in b.scan.skipped})
        parts.append(f"{len(b.scan.skipped)} all_reduce(s) left alone and not in the "
                     f"bound ({'; '.join(reasons)})")
    return "; ".join(parts)


REMEDIES = {
    "cut differently": "keep graph breaks alike on every rank: a print or a log call on one "
                       "rank cuts that rank's graph (torch._dynamo.config."
                       "reorderable_logging_functions.add(print) keeps it whole, for a print "
                       "without keyword arguments such as flush=True: torch 2.15 cuts at "
                       "those), or log outside the compiled function",
    "timed out": "if the peers are only slow to compile this graph, raise "
                 "Config.agree_timeout_s (FXCOALESCE_AGREE_TIMEOUT); if they never compile "
                 "it, they cut the program elsewhere: keep graph breaks alike on every rank",
    "peer gone": "a peer's process ended: see its log",
    "cut varies": "keep graph breaks the same at every call: a print or log call that only "
                  "some steps reach cuts those steps' graphs (torch._dynamo.config."
                  "reorderable_logging_functions.add(print) keeps it whole), or log outside "
                  "the compiled function",
    "runs uncompiled": "a peer runs this stretch without compiling it (Dynamo skipped the "
                       "frame there: a graph break inside a loop, torch.compiler.disable, "
                       "the recompile limit); keep graph breaks alike on every rank",
    "guards differ": "read that value on every rank, or move the rank-dependent part "
                     "(logging on rank 0) out of the compiled function; "
                     "torch._dynamo.config.reorderable_logging_functions.add(print) keeps a "
                     "print without keyword arguments from cutting the graph",
    "program differs": "the program itself issues different collectives on different ranks",
    "decided before": "compile different models through different functions "
                      "(torch.compile(model) for each, not one step function called with "
                      "each model): each then has its own agreement",
    "fell back": "the ranks' rewrites differ (compute that differs by rank); "
                 "report.agreement lists the differences",
}
"""What to do about each way the ranks can miss a rewrite (``Agreement.how``)."""


def explain_agreement(report: Report) -> None:
    """Where the agreement, not the graph, kept ``report``'s graph above its bound: say so
    in the verdict (the cause, where a peer cut its graph when known, what to do) and in a
    warning."""
    how = report.agreement.get("how", "")
    a = report.all_reduce
    above = a["after"] - a["left_alone"] - a["lower_bound"]
    if how not in REMEDIES or above <= 0:
        return
    why = report.agreement.get("why") or "; ".join(report.agreement.get("differences", []))
    text = (f"{above} launch(es) above the bound because every rank runs this graph "
            f"{report.agreement.get('step', 'in the program order')} ({how}: {why}); "
            f"{REMEDIES[how]}")
    report.verdict = text
    report.warnings.append(f"agreement: {text}")


def build_report(graph: str, before: Analysis, after: Analysis, *, cost: CostModel,
                 passes: list[dict], buckets: list[dict], decisions: list[dict],
                 warnings: list[str],
                 analysis_ms: float, fell_back: bool) -> Report:
    world, backend = group_setup(before.scan)
    modules = collective_modules(before)
    warn = [f"{_named(n.name, modules)}: left alone: {why}"
            for n, why in (*before.scan.skipped, *before.scan.unknown)]
    bytes_of = lambda a: sum(i.block.nbytes for i in a.infos)  # noqa: E731
    bound = bound_analysis(before, after)
    behind = originals(buckets)
    where = lambda r: with_origins(r, behind, modules)  # noqa: E731
    return Report(
        graph=graph, world_size=world, backend=backend,
        all_reduce={"before": before.all_reduce_count, "after": after.all_reduce_count,
                    "lower_bound": bound.lower_bound,
                    "left_alone": len(bound.scan.skipped),
                    "bytes_before": bytes_of(before), "bytes_after": bytes_of(after)},
        predicted_comm_us={"before": predict(before, cost, world or 2),
                           "after": predict(after, cost, world or 2),
                           "world_size_assumed": world or 2,
                           "model": cost.profile.source if cost.profile else "default"},
        chains={str(k): v for k, v in bound.chains.items()},
        buckets=[where(b) for b in buckets],
        decisions=[named_impls(where(d), default_impl(backend)) for d in decisions],
        modules=modules,
        windows=[{"node": i.block.collective.name, "level": i.level, "ready": i.ready,
                  "need": i.need, "slack": i.slack, "bytes": i.block.nbytes,
                  "symbolic": i.block.symbolic}
                 for i in before.infos],
        passes=passes, analysis_ms=round(analysis_ms, 3),
        nodes={"before": len(before.order), "after": len(after.order)},
        other_collectives=dict(before.scan.other),
        warnings=warn + warnings, fell_back=fell_back,
        verdict=verdict(before, after, decisions),
    )


def collective_modules(analysis: Analysis) -> dict[str, str]:
    """FX name -> module path (``meta.module_path``) of every collective ``analysis`` saw,
    opaque communication included."""
    scan = analysis.scan
    return {n.name: module_path(n) for n in (*scan.sequence, *(n for n, _ in scan.unknown))}


def _named(name: str, modules: dict[str, str]) -> str:
    return f"{modules[name]} ({name})" if modules.get(name) else name


def originals(buckets: list[dict]) -> dict[str, list[str]]:
    """FX name of each collective a pass made -> the program's own collectives behind it (a
    later pass's members can be an earlier pass's collectives: a bucket of sliced ones)."""
    behind: dict[str, list[str]] = {}
    for b in buckets:
        behind[b["collective"]] = [o for m in b["members"] for o in behind.get(m, [m])]
    return behind


def with_origins(record: dict, behind: dict[str, list[str]], modules: dict[str, str]) -> dict:
    """``record`` (a bucket or decision) with the ``originals`` behind its members and their
    ``modules``."""
    names = [o for m in record["members"] for o in behind.get(m, [m])]
    return {**record, "originals": names, "modules": [modules.get(n, "") for n in names]}


def named_impls(decision: dict, default: str) -> dict:
    """``decision`` with the passes' "nccl" (the group's own all_reduce) named ``default``,
    in what it chose and in the keys of its predictions and reasons."""
    if default == "nccl":
        return decision
    name = lambda k: default if k == "nccl" else k  # noqa: E731
    return {k: ({name(i): x for i, x in v.items()} if isinstance(v, dict)
                else name(v) if k == "chose" else v) for k, v in decision.items()}


def record(report: Report) -> None:
    """Keep ``report`` (``reports()``) and log it; a graph break Dynamo made at a collective
    given ``dist.ReduceOp`` since the last report joins this one's warnings and verdict."""
    breaks = reduce_op_breaks()
    if breaks:
        report.warnings += breaks
        report.verdict += (f"; Dynamo broke the program at {len(breaks)} collective(s) given "
                           f"dist.ReduceOp, which run uncompiled ({ADVICE})")
    _REPORTS.append(report)
    log.info(report.summary())
    for w in report.warnings:
        log.warning("fxcoalesce[%s]: %s", report.graph, w)


class ReportList(list):
    """A list of reports that says why it is empty when indexed."""

    def __getitem__(self, i):
        if not self and not isinstance(i, slice):  # a slice of none is [], as for a list
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
