"""schedule: issue each all_reduce as early as its input allows, wait right before first use.

Requires: a valid graph. Ensures: same nodes, same values; only the order changes, and
side-effecting nodes keep their place. Collectives move up to just after their input; each
wait moves down to just before its first consumer, so independent compute runs while the
collective is in flight.

    before                          after
    %ar = all_reduce(%x)            %ar = all_reduce(%x)
    %w = wait_tensor(%ar)           %y = mm(%a, %b)        # overlaps the all_reduce
    %y = mm(%a, %b)                 %w = wait_tensor(%ar)
    %z = add(%w, %y)                %z = add(%w, %y)
"""

from __future__ import annotations

from torch.fx import GraphModule

from fxcoalesce.analysis import analyze
from fxcoalesce.config import Config
from fxcoalesce.graph_order import reorder

from .emit import place
from .result import PassResult


def schedule_pass(gm: GraphModule, *, cfg: Config, pinned: frozenset = frozenset()
                  ) -> PassResult:
    analysis = analyze(gm)
    if not analysis.infos:
        return PassResult()
    before = list(gm.graph.nodes)
    priority = {n: float(i) for n, i in analysis.order.items()}
    for info in analysis.infos:
        place(priority, [info.block.collective], after=info.ready)
        place(priority, [info.block.wait], after=info.need - 1)
    reorder(gm.graph, priority, set(analysis.barriers))
    return PassResult(changed=list(gm.graph.nodes) != before)
