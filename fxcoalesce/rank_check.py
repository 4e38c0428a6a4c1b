"""Compare the collective sequence of a compiled graph across the ranks of each group it uses.

Ranks pair collectives by issue order, and ranks' graphs can differ (Dynamo turns
``dist.get_rank()`` into a constant). :func:`mismatch` is the one comparison the backend and
``inductor_pass()`` make (see ``agreement``): over each group, every rank all-gathers a
32-byte digest of its sequence on that group; only when the digests differ do the ranks
exchange the sequences themselves, to name the first difference.

    rank 0: all_reduce(sum, 0) -> float32[4, 8], all_reduce(max, 0) -> float32[2, 3]
    rank 1: all_reduce(max, 0) -> float32[2, 3], all_reduce(sum, 0) -> float32[4, 8]
    mismatch(...) == "group 0: collective #0: rank 0 issues all_reduce(sum, 0) -> ..."

Plain tensor collectives only (no pickling, so no numpy), on the group's own device.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("fxcoalesce")

Sequence = list[tuple[str | None, str]]
"""(group name, description) per collective, in issue order (``collectives.issue_sequence``)."""


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group would issue different collective sequences."""


def groups_of(sequence: Sequence) -> list[str]:
    """Group names a sequence uses, in a rank-invariant order (collectives of opaque ops name
    no group: they are compared within every group)."""
    return sorted({g for g, _ in sequence if g is not None})


def on_group(sequence: Sequence, name: str) -> list[str]:
    """The descriptions of the collectives that run on group ``name`` (and the opaque ones)."""
    return [d for g, d in sequence if g in (name, None)]


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


def _device(group) -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl" else torch.device("cpu"))


@contextlib.contextmanager
def _real_tensors():
    """Real tensors even where a compile has a fake mode or other dispatch modes active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        yield


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(out, t, group=group)
    return [o.cpu() for o in out]


def _gather_texts(text: str, group) -> list[str]:
    device = _device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    sizes = _all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=device), group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    return [bytes(p[:int(s)].tolist()).decode() for p, s in zip(_all_gather(padded, group), sizes)]


def mismatch(sequence: Sequence) -> str | None:
    """Compare ``sequence`` across the ranks of every group it uses (a collective call on
    each, so every rank of those groups must call it at the same point); return the first
    difference as a sentence, or None. A rank whose own groups agree but which shares a group
    with one that saw a difference learns of it too, so all ranks decide alike."""
    groups = groups_of(sequence)
    problem = None
    with _real_tensors():
        for name in groups:
            group = _resolve(name)
            text = "\n".join(on_group(sequence, name))
            digest = torch.tensor(list(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8,
                                  device=_device(group))
            if all(torch.equal(d, digest.cpu()) for d in _all_gather(digest, group)):
                continue
            texts = [t.split("\n") if t else [] for t in _gather_texts(text, group)]
            found = first_difference(texts, dist.get_process_group_ranks(group))
            problem = problem or f"group {name}: {found}"
        if len(groups) > 1:  # spread the verdict through every group, as far as they reach
            flag = torch.tensor([int(problem is not None)], dtype=torch.int32)
            for _ in groups:
                for name in groups:
                    group = _resolve(name)
                    f = flag.to(_device(group))
                    dist.all_reduce(f, dist.ReduceOp.MAX, group=group)
                    flag = f.cpu()
            if flag.item() and problem is None:
                problem = "a group this rank shares with others saw a difference (see their log)"
    return problem
