"""Collective sequences as ranks compare them, and the error for ranks that differ.

Ranks pair collectives by issue order, and ranks' graphs can differ (Dynamo turns
``dist.get_rank()`` into a constant). The ranks compare their sequences through the store,
never with a collective (``agreement``, ``exchange``); this module holds what that needs:

    rank 0: all_reduce(sum, 0) -> float32[4, 8], all_reduce(max, 0) -> float32[2, 3]
    rank 1: all_reduce(max, 0) -> float32[2, 3], all_reduce(sum, 0) -> float32[4, 8]
    first_difference(...) == "collective #0: rank 0 issues all_reduce(sum, 0) -> ..."
"""

from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger("fxcoalesce")

Sequence = list[tuple[str | None, str]]
"""(group name, description) per collective, in issue order (``collectives.issue_sequence``)."""


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group would issue different collective sequences."""

    def __init__(self, *args):
        super().__init__(*args)
        RAISED[0] = True
        from .exchange import cancel_interrupt, say_stopped

        cancel_interrupt()  # this rank says it itself: no second error from the store
        say_stopped(str(self))  # and every peer hears it, even one outside the pairing


RAISED = [False]
"""This process made a :class:`CollectiveMismatchError` (its heartbeat then sends it none)."""


def groups_of(sequence: Sequence) -> list[str]:
    """Group names a sequence uses, in a rank-invariant order (collectives of opaque ops name
    no group: they are compared within every group)."""
    return sorted({g for g, _ in sequence if g is not None})


def first_difference(sequences: list[list[str]], ranks: list[int]) -> str | None:
    """A sentence naming the first place where any rank's sequence differs from the first's."""
    ref = sequences[0]
    for seq, rank in zip(sequences[1:], ranks[1:]):
        if seq == ref:
            continue
        i = next((k for k, (a, b) in enumerate(zip(ref, seq)) if a != b), min(len(ref), len(seq)))
        mine = seq[i] if i < len(seq) else "nothing (its sequence ends)"
        theirs = ref[i] if i < len(ref) else "nothing (its sequence ends)"
        return (f"collective #{i}: rank {ranks[0]} issues {theirs}, rank {rank} issues {mine} "
                f"({len(ref)} vs {len(seq)} collectives in all)")
    return None


def _resolve(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def has_peers(sequence: Sequence) -> bool:
    """Do the sequence's collectives run over a real group of more than one rank? (Not over a
    fake group, whose "peers" never run.)"""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    for name in groups_of(sequence):
        try:
            group = _resolve(name)
        except Exception:  # a name no group here has (hand-built graphs)
            continue
        if dist.get_backend(group) != "fake" and group.size() > 1:
            return True
    return False
