"""Which collectives of a graph open its run-time check, and so stay as the program has them.

A rewritten graph carries a tag on its first all_reduce in each group (``ranks.tag``). That
all_reduce, and the group's collectives before it, keep their kind, op, dtype and element
count through every pass (:func:`pinned`): the pipeline computes them once and hands them to
every pass, so a rewritten graph's first tag in a group pairs, element for element, with the
program's first all_reduce there. Passes read this module's answer; they know nothing of
ranks.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from .collectives import ALL_REDUCE, group_of, op_of
from .meta import tensor_val

OPS = ("sum", "avg", "max", "min")
"""Reduce ops a tag rides on; others (product) are issued untagged (on every rank alike)."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
          torch.int64)
MAX_WORLD = 128
"""The largest group a tag is exact in (bfloat16's mean)."""


def taggable_value(op: str, dtype: torch.dtype, world: int) -> bool:
    """Is an all_reduce of ``op`` over ``dtype`` on ``world`` ranks tagged?"""
    return op in OPS and dtype in DTYPES and world <= MAX_WORLD


def taggable(node: Node, world: int) -> bool:
    """Does this collective carry a tag: a functional all_reduce of a tagged op and dtype?"""
    val = tensor_val(node.args[0]) if op_of(node) is ALL_REDUCE else None
    return val is not None and taggable_value(str(node.args[1]), val.dtype, world)


def group_members(name: str | None) -> frozenset[int] | None:
    """The global ranks of a group: the process group's, else a simulated one's
    (``fxcoalesce.testing.simulated_groups``); None when neither is known."""
    import torch.distributed as dist

    from .testing import simulated_group_members

    if name is None:
        return None
    try:
        group = dist.distributed_c10d._resolve_process_group(name)
        return frozenset(dist.get_process_group_ranks(group))
    except Exception:  # unknown group names (hand-built graphs)
        ranks = simulated_group_members(name)
        return None if ranks is None else frozenset(ranks)


class Firsts:
    """The check's places, found one collective at a time in issue order: per group, its
    first taggable all_reduce, unless the group's ranks all sit in a group whose check came
    before the group's first collective (that check already stops the graph on each of them).
    Used alike on a compiled graph (:func:`checked_firsts`) and on a run Dynamo leaves
    uncompiled (``ranks.hooks``), so both put the tag on the same collective."""

    def __init__(self):
        self.firsts: dict[str | None, object] = {}
        self.covered: set[str | None] = set()
        self.seen: set[str | None] = set()

    def opens(self, group: str | None, is_all_reduce: bool, taggable_kind: bool, item) -> bool:
        """Record one collective; True where it is its group's checked first all_reduce."""
        if group not in self.seen:
            self.seen.add(group)
            ranks = group_members(group)
            if ranks is not None and any(ranks <= (group_members(g) or frozenset())
                                         for g in self.firsts):
                self.covered.add(group)
        if (group in self.covered or group in self.firsts or not is_all_reduce
                or not taggable_kind):
            return False
        self.firsts[group] = item
        return True


def _firsts(collectives: list[Node]) -> Firsts:
    f = Firsts()
    for n in collectives:
        f.opens(group_of(n), op_of(n) is ALL_REDUCE, op_of(n) is ALL_REDUCE and taggable(n, 2), n)
    return f


def checked_firsts(collectives: list[Node]) -> dict[str | None, Node]:
    """The all_reduces that open a rewritten graph's checks, from its collectives in issue
    order (:class:`Firsts`)."""
    return _firsts(collectives).firsts


def pinned(sequence: list[Node], run_checks: bool) -> frozenset[Node]:
    """With run-time checks, the graph's collectives up to and including each
    :func:`checked_firsts` all_reduce, in its group, and every collective of a group that has
    none (no tag guards a rewrite there: it keeps the program's own collectives). None in a
    covered group or a group of one rank. ``sequence``: the collectives in issue order."""
    if not run_checks:
        return frozenset()
    found = _firsts(sequence)
    out, done = set(), set()
    for n in sequence:
        group = group_of(n)
        if group in found.covered or group in done or len(group_members(group) or ()) < 2:
            continue
        out.add(n)
        if n is found.firsts.get(group):
            done.add(group)
    return frozenset(out)


def pinned_blocks(scan, pinned: frozenset[Node]) -> set:
    """The comm blocks of ``scan`` whose collective is in ``pinned`` (what a pass leaves as
    it is)."""
    return {b for b in scan.blocks if b.collective in pinned} if pinned else set()
