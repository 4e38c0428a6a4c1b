"""A predicted two-lane timeline of one step: compute on one lane, communication on the
other (what ``inspect --timeline`` draws), from the cost model of ``fxcoalesce.cost``.

Compute nodes run end to end in node order, each for its roofline time (``cost.node_us``).
An all_reduce is issued when its input is computed and runs on the communication lane, one
collective at a time in issue order; the first consumer of its wait cannot start before it
ends, which leaves a gap on the compute lane. The part of a collective that overlaps
compute is *hidden*, the rest *exposed*.

    compute  [mm][add][mm]........[mm][add]       .... = waiting for AR2
    comm          [AR1  ][AR2            ]
                  hidden  hidden | exposed

Unlike the report's ``predicted_comm_us`` (each all_reduce judged alone), collectives here
queue behind each other and a wait delays everything after it, so the exposed time can be
larger. Analysed all_reduces only, as in the report. What the prediction assumes (which
device's roofline, calibrated or not) is in ``Timeline.assumes`` (:func:`assumptions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import GraphModule

from fxcoalesce.analysis import analyze
from fxcoalesce.config import CostModel
from fxcoalesce.cost import Roofline, graph_device, node_us


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    start_us: float
    end_us: float


@dataclass(slots=True)
class Timeline:
    """Spans on the two lanes; ``hidden`` are the parts of ``comm`` that overlap compute."""

    title: str
    compute: list[Span] = field(default_factory=list)
    comm: list[Span] = field(default_factory=list)
    hidden: list[Span] = field(default_factory=list)
    assumes: str = ""
    """What a predicted timeline rests on (:func:`assumptions`); "" for a measured one."""

    @property
    def end_us(self) -> float:
        return max((s.end_us for s in (*self.compute, *self.comm)), default=0.0)

    @property
    def comm_us(self) -> float:
        return sum(s.end_us - s.start_us for s in self.comm)

    @property
    def hidden_us(self) -> float:
        return sum(s.end_us - s.start_us for s in self.hidden)

    def summary(self) -> str:
        return (f"{self.title}: step {self.end_us:.0f} µs, communication {self.comm_us:.0f} µs "
                f"({self.comm_us - self.hidden_us:.0f} exposed)")


def merged(spans: list[Span]) -> list[tuple[float, float]]:
    """The union of ``spans`` as sorted, disjoint (start, end) intervals."""
    out: list[list[float]] = []
    for s in sorted(spans, key=lambda s: s.start_us):
        if out and s.start_us <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s.end_us)
        else:
            out.append([s.start_us, s.end_us])
    return [(a, b) for a, b in out]


def overlaps(comm: list[Span], busy: list[tuple[float, float]]) -> list[Span]:
    """The parts of each ``comm`` span that fall inside the ``busy`` intervals."""
    out = []
    for c in comm:
        for a, b in busy:
            lo, hi = max(a, c.start_us), min(b, c.end_us)
            if hi > lo:
                out.append(Span(c.name, lo, hi))
    return out


def assumptions(cost: CostModel, device: str) -> str:
    """The cost model's assumptions in a line: the all_reduce model (a calibrated profile or
    the uncalibrated ring) and the compute roofline of ``device``, defaults named as such."""
    roof = Roofline.of(cost, device)
    comm = (f"all_reduce from the profile {cost.profile.source}" if cost.profile is not None
            else f"uncalibrated default cost model: all_reduce a ring over PCIe "
                 f"({cost.bandwidth_gbps:g} GB/s)")
    own = all(v is not None for v in (cost.peak_tflops, cost.memory_gbps, cost.kernel_us))
    return (f"{comm}; compute a {device.upper()} roofline ({roof.peak_tflops:g} TFLOP/s, "
            f"{roof.memory_gbps:g} GB/s, {roof.kernel_us:g} µs a kernel"
            f"{'' if own else ', defaults'})")


def predict_timeline(gm: GraphModule, cost: CostModel, world: int, title: str = "") -> Timeline:
    """The step of ``gm`` on two lanes, as the cost model sees it (see the module doc)."""
    analysis = analyze(gm)
    device = graph_device(analysis)
    roof = Roofline.of(cost, device)
    by_input: dict = {}
    waits_at: dict[int, list] = {}
    for info in analysis.infos:
        by_input.setdefault(info.block.input, []).append(info)
        waits_at.setdefault(info.need, []).append(info)
    by_collective = {info.block.collective: info for info in analysis.infos}
    ready: dict = {}  # info -> when its input was computed
    ends: dict = {}
    timeline = Timeline(title, assumes=assumptions(cost, device))
    now = comm_free = 0.0
    for i, node in enumerate(analysis.order):
        for info in waits_at.get(i, ()):
            now = max(now, ends[info])
        dt = node_us(node, roof)
        if dt > 0:
            timeline.compute.append(Span(node.name, now, now + dt))
            now += dt
        for info in by_input.get(node, ()):
            ready[info] = now
        if (info := by_collective.get(node)) is not None:
            start = max(ready[info], comm_free)
            ends[info] = comm_free = start + cost.all_reduce_us(info.block.nbytes, world)
            timeline.comm.append(Span(node.name, start, ends[info]))
    timeline.hidden = overlaps(timeline.comm, merged(timeline.compute))
    return timeline
