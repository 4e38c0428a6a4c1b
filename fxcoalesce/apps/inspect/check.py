"""What the run-time check (``ranks.tag``) adds to a rewritten step, counted as the run
sends it: a rewritten graph's first all_reduce per group carries a ``2 * TAG_BITS``-element
tag, and the collective after it one element made from the check (the gate); a graph that
keeps the program's own order carries nothing. The demo counts these bytes at run time
(neox-tiny, 3 tokens, float32: 3840 + 132); ``inspect`` counts them from ``ranks.tag.plan``
of the rewritten graph, the all_reduces the tag pass would tag."""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import GraphModule


@dataclass(frozen=True, slots=True)
class CheckCost:
    bytes: int
    """Bytes the tags and gates add to the step's all_reduces."""
    tags: int
    """All_reduces that carry a tag (one per group the graph checks)."""
    gates: int
    """All_reduces that carry the one-element gate."""
    tag_elements: int
    rewritten: bool

    def text(self) -> str:
        """The table's one line on what the run-time check costs."""
        if not self.rewritten:
            return ("none: the step keeps the program's own order, which carries no tag "
                    "(only rewritten graphs are checked)")
        if not self.tags:
            return "none: no all_reduce of this step can carry the tag (its op or dtype)"
        gate = (f", 1 element on the next all_reduce{'s' if self.gates > 1 else ''}"
                if self.gates else "")
        return (f"{self.bytes} bytes a step: a {self.tag_elements}-element tag on the first "
                f"all_reduce{' of each group' if self.tags > 1 else ''}{gate}, and one small "
                "check kernel; Config(run_checks=False) removes it")

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "tags": self.tags, "gates": self.gates,
                "tag_elements": self.tag_elements, "rewritten": self.rewritten}


def check_cost(after: GraphModule, world: int, *, rewritten: bool,
               run_checks: bool = True) -> CheckCost:
    """The check's bytes for ``after``, the pipeline's graph (untagged), on ``world`` ranks:
    nothing unless ``rewritten`` (the run tags only graphs whose collectives differ from the
    program's) and ``run_checks``."""
    from fxcoalesce.meta import tensor_val
    from fxcoalesce.ranks.tag import TAG_BITS, plan

    elements = 2 * TAG_BITS
    if not (rewritten and run_checks):
        return CheckCost(0, 0, 0, elements, rewritten and run_checks)
    total = tags = gates = 0
    for node, role in plan(after, world=lambda n: world):
        size = tensor_val(node.args[0]).dtype.itemsize
        if role == "tag":
            tags += 1
            total += elements * size
        else:
            gates += 1
            total += size
    return CheckCost(total, tags, gates, elements, True)
