"""Compare the collective sequence of a compiled graph across ranks before it first runs.

Ranks pair collectives by issue order. If their compiled graphs issue different sequences
(graphs that differ by rank in a way the passes could not see), the job computes garbage
or aborts far from the cause. With ``Config(check_ranks=True)`` (or
``FXCOALESCE_CHECK_RANKS=1``) the backend wraps each compiled graph: on its first call, every
rank all-gathers its sequence over each group the graph uses and raises
:class:`CollectiveMismatchError` naming the first difference, before any data collective runs.

    rank 0: all_reduce(sum, 0) -> float32[4, 8], all_reduce(max, 0) -> float32[2, 3]
    rank 1: all_reduce(max, 0) -> float32[2, 3], all_reduce(sum, 0) -> float32[4, 8]
    CollectiveMismatchError: ... collective #0: rank 0 issues all_reduce(sum, 0) -> ...
"""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist

log = logging.getLogger("fxcoalesce")


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group would issue different collective sequences."""


def groups_of(sequence: list[tuple[str | None, str]]) -> list[str]:
    """Group names a sequence of (group, description) uses, in a rank-invariant order
    (collectives of opaque ops name no group: they are compared within the others)."""
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


def has_peers(sequences: list[list[tuple[str | None, str]]]) -> bool:
    """Do the graphs' collectives run over a real group of more than one rank?"""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for name in groups_of([item for seq in sequences for item in seq]):
        try:
            group = _resolve_process_group(name)
        except Exception:
            continue
        if dist.get_backend(group) != "fake" and group.size() > 1:
            return True
    return False


def mismatch(sequence: list[tuple[str | None, str]]) -> str | None:
    """All-gather ``sequence`` over every group it uses; the first difference, or None."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    described = [f"{d} [group {g}]" for g, d in sequence]
    for name in groups_of(sequence):
        group = _resolve_process_group(name)
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, described, group=group)
        problem = first_difference(gathered, dist.get_process_group_ranks(group))
        if problem:
            return f"group {name}: {problem}"
    return None


def _raise(graph_name: str, problem: str) -> None:
    raise CollectiveMismatchError(
        f"fxcoalesce check_ranks: {graph_name} would issue different collective sequences on "
        f"the ranks of {problem}. Ranks pair collectives by order, so this run would compute "
        "wrong values or hang. The graphs differ between ranks in which collectives depend on "
        "which (or in their sizes); make that rank-independent, or compile this code without "
        "fxcoalesce.")


def checked(compiled, graph_name: str, sequences: list[list[tuple[str | None, str]]],
            fallback=None):
    """``compiled``, checked against the other ranks on its first call.

    On a difference, ``fallback()`` (when given) must return ``(compiled, sequences)`` of a
    graph whose sequence is rank-invariant by construction; every rank sees the same gathered
    sequences, so all of them switch together. Without one, or if the fallback differs too,
    :class:`CollectiveMismatchError` names the first difference.
    """
    state = {"fn": None}

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        if state["fn"] is None:
            fn, seqs = compiled, sequences
            problem = mismatch([item for seq in seqs for item in seq])
            if problem and fallback is not None:
                log.warning("fxcoalesce[%s]: ranks chose different collectives (%s); all "
                            "ranks recompile with every group merged", graph_name, problem)
                fn, seqs = fallback()
                problem = mismatch([item for seq in seqs for item in seq])
            if problem:
                _raise(graph_name, problem)
            state["fn"] = fn
        return state["fn"](*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run
