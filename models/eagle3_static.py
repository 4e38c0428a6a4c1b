"""EAGLE-3 greedy decoding in fixed shapes, one compiled step per verify, no host sync inside.

``models.eagle3`` spells the algorithm out with Python lists and host reads; a small target
(SmolLM2-135M runs a forward in about a millisecond on an H200) is then bound by kernel
launches and host syncs. Here a whole speculative step is one function of fixed-shape
tensors, for ``torch.compile(mode="reduce-overhead")`` (one CUDA graph):

    state  [M + 2] long   (L, n, x_1 .. x_M): L tokens committed to the target's cache; the
                          first n of x_1.. are the newest tokens, the last of them the root
    hidden [M, 3H]        the target states of the pairs (x_i, h) the draft has not seen
    spec_step:  draft_tree_static -> verify_accept_static -> (state', hidden')

with M = depth + 1, the most tokens one step can emit. The draft catches up on all M pairs
(the n real ones first: rows past them write slots that the tree overwrites before anyone
reads them), drafts the same tree as ``eagle3.draft_tree`` and the target verifies it; the
accepted path is found from the tree mask (no retrieve_indices, whose size varies), its KV
entries moved, all in the graph. The host reads ``state`` once per step (tokens, stop test):
on a GPU while the next step runs (``ahead``, ``_Steps``).

The prefill can be one graph too (``prefill_static``, ``spec_prefill_static``: the prompt
padded to a multiple of 64, ``pad_prompt``): eagerly it launched ~1,500 kernels one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Collection

import torch
from torch import nn

from .eagle3 import Eagle3Draft, SpecStats, Tree, kv_caches, prefill


@dataclass(kw_only=True, frozen=True)
class TreeSpec:
    top_k: int = 8
    """Children per expanded node, and nodes expanded per level."""
    depth: int = 6
    """Draft levels below the root (the most draft tokens one step can accept)."""
    total_tokens: int = 64
    """Nodes verified per step, root included."""

    def __post_init__(self) -> None:
        most = 1 + self.top_k + (self.depth - 1) * self.top_k**2
        if self.top_k < 1 or self.depth < 1 or not 1 < self.total_tokens <= most:
            raise ValueError(f"total_tokens ({self.total_tokens}) must be in [2, {most}] for "
                             f"top_k={self.top_k}, depth={self.depth} (both >= 1)")

    @property
    def pairs(self) -> int:
        """M: tokens one step emits at most (depth accepted + 1 bonus)."""
        return self.depth + 1

    def draft_slots(self) -> int:
        """Draft cache slots needed past the committed length."""
        return max(self.pairs, (self.depth - 1) * self.top_k)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def topk_rows(x: torch.Tensor, k: int, chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k)`` over the last dimension (the same values, descending; ties may pick other
    indices) in two sorts of short rows: each ``chunk`` of a row its top k, then the row's
    top k of those. On an H100 ``topk`` of 8 over a draft vocabulary of 8192 took 45 us a call
    (a radix select, one block a row: 8 blocks), five of them a step of the (8, 6, 64) tree;
    a sort of rows of 128 is one kernel over many blocks (benchmarks/NOTES.md, session 10)."""
    *lead, V = x.shape
    if V <= chunk or V % chunk:
        v, i = x.sort(-1, descending=True)
        return v[..., :k], i[..., :k]
    v, i = x.reshape(*lead, V // chunk, chunk).sort(-1, descending=True)
    base = torch.arange(0, V, chunk, device=x.device)[:, None]
    v, i = v[..., :k].flatten(-2), (i[..., :k] + base).flatten(-2)  # [..., V / chunk * k]
    v, j = v.sort(-1, descending=True)
    return v[..., :k], i.gather(-1, j[..., :k])


def draft_tree_static(draft: Eagle3Draft, tokens: torch.Tensor, hidden: torch.Tensor,
                      n: torch.Tensor, L: torch.Tensor, spec: TreeSpec):
    """tokens [M], hidden [M, 3H]: the pairs at positions L - n .. L - 1 (first n real), n and
    L 0-d long tensors -> (tokens [N], parents [N] (root: 0), depth [N], mask [N, N], scores [N]),
    the tree ``eagle3.draft_tree`` drafts from the same pairs."""
    k, N, dev = spec.top_k, spec.total_tokens, tokens.device
    M, T = tokens.shape[0], draft.k_cache.shape[1]
    slots = torch.arange(T, device=dev)
    pos = L - n + torch.arange(M, device=dev)
    logits, out = draft(tokens[None], draft.fc(hidden[None]), pos, pos,
                        (slots[None, :] <= pos[:, None])[None, None])
    last = (n - 1).view(1)  # the root's row
    scores, ids = topk_rows(logits[0].index_select(0, last)[0].to(_acc(logits.dtype))
                            .log_softmax(-1), k)
    pool_ids, pool_scores = [ids], [scores]
    pool_parent = [torch.full((k,), -1, device=dev)]
    pool_level = [torch.zeros(k, dtype=torch.long, device=dev)]
    frontier = torch.arange(k, device=dev)  # pool indices of the nodes to feed next
    frontier_hidden = out[0].index_select(0, last).expand(k, -1)  # [k, H]
    frontier_sees = (slots < L).expand(k, -1)  # [k, T]: the prefix and their ancestors' slots
    for d in range(1, spec.depth):
        node_slots = L + (d - 1) * k + torch.arange(k, device=dev)
        sees = frontier_sees | (slots[None, :] == node_slots[:, None])
        flat_ids, flat_scores = torch.cat(pool_ids), torch.cat(pool_scores)
        node_pos = (L - 1 + d).expand(k)
        logits, out = draft(draft.to_target(flat_ids[frontier])[None], frontier_hidden[None],
                            node_pos, node_slots, sees[None, None])
        child_scores, child_ids = topk_rows(logits[0].to(_acc(logits.dtype)).log_softmax(-1), k)
        child_scores = flat_scores[frontier][:, None] + child_scores  # [k, k]
        pool_ids.append(child_ids.flatten())
        pool_scores.append(child_scores.flatten())
        pool_parent.append(frontier.repeat_interleave(k))
        pool_level.append(torch.full((k * k,), d, device=dev))
        best = topk_rows(child_scores.flatten(), k)[1]
        parent = best // k
        frontier, frontier_hidden = flat_ids.shape[0] + best, out[0, parent]
        frontier_sees = sees[parent]
    all_scores = torch.cat(pool_scores)
    order = torch.sort(all_scores, descending=True, stable=True).indices
    keep = order[: N - 1].sort().values  # pool order: ancestors before descendants
    node_of = torch.zeros_like(all_scores, dtype=torch.long).index_copy(
        0, keep, torch.arange(1, N, device=dev))
    parent_pool = torch.cat(pool_parent)[keep]
    parents = torch.cat([parent_pool.new_zeros(1),
                         torch.where(parent_pool >= 0, node_of[parent_pool.clamp(min=0)], 0)])
    depth = torch.cat([parents.new_zeros(1), torch.cat(pool_level)[keep] + 1])
    mask = torch.eye(N, dtype=torch.bool, device=dev)
    for _ in range(spec.depth):  # each pass adds one more generation of ancestors
        mask = mask | mask[parents]
    tree_tokens = torch.cat([tokens.index_select(0, last),
                             draft.to_target(torch.cat(pool_ids)[keep])])
    return tree_tokens, parents, depth, mask, torch.cat([all_scores.new_zeros(1), all_scores[keep]])


def verify_accept_static(target: nn.Module, tree_tokens, parents, depth, mask, L: torch.Tensor,
                         pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the tree at cache slots L .., accept greedily, move the accepted path's KV
    entries to slots L .. -> (state [pairs + 2], hidden [pairs, 3H]) for the next step."""
    N, dev = tree_tokens.shape[0], tree_tokens.device
    T = kv_caches(target)[0].shape[1]
    nodes, slots, steps = (torch.arange(m, device=dev) for m in (N, T, pairs))
    rel = slots - L  # [T]: tree node held by each slot
    in_tree = (rel >= 0) & (rel < N)
    visible = (slots[None, :] < L) | (mask[:, rel.clamp(0, N - 1)] & in_tree[None, :])  # [N, T]
    logits, hidden = target(tree_tokens[None], L + depth, L + nodes, visible[None, None])
    pred = logits[0].argmax(-1)  # [N]
    right = (tree_tokens == pred[parents]) | (nodes == 0)
    accepted = ~(mask & ~right[None, :]).any(1)  # the node and all its ancestors are right
    best = (depth * accepted).argmax().view(1)  # the deepest accepted node (siblings differ)
    n_acc = depth.index_select(0, best)  # [1]
    on_path = mask.index_select(0, best) & (depth[None, :] == steps[:, None])  # [pairs, N]
    path = (on_path.long() * nodes).sum(1)  # node at each depth; the root past the path's end
    new = torch.where(steps < n_acc, tree_tokens[path.roll(-1)], pred.index_select(0, best))
    dst, src = L + steps, L + path
    for cache in kv_caches(target):
        cache.index_copy_(1, dst, cache.index_select(1, src))
    state = torch.cat([L + n_acc + 1, n_acc + 1, new])
    return state, hidden[0, path]


def spec_step(target: nn.Module, draft: Eagle3Draft, state: torch.Tensor, hidden: torch.Tensor,
              spec: TreeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step: (state, hidden) -> (state', hidden'); see the module docstring."""
    L, n, tokens = state[0], state[1], state[2:]
    tree = draft_tree_static(draft, tokens, hidden, n, L, spec)
    return verify_accept_static(target, *tree[:4], L, spec.pairs)


def decode_step(target: nn.Module, state: torch.Tensor) -> torch.Tensor:
    """Target-only greedy decoding, one token: state [2] (token, its position) -> the next."""
    T = kv_caches(target)[0].shape[1]
    pos = state[1:]
    visible = torch.arange(T, device=state.device) <= pos
    logits, _ = target(state[None, :1], pos, pos, visible[None, None, None])
    return torch.cat([logits[0, -1].argmax().view(1), pos + 1])


PREFILL_BUCKET = 64
"""A compiled prefill takes the prompt padded to a multiple of this (one graph for prompts
of 1-64 tokens, one more per further 64)."""


def pad_prompt(prompt: torch.Tensor, bucket: int = PREFILL_BUCKET
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt [P] -> (tokens [B], P as a 0-d long tensor): B is P rounded up to ``bucket``, the
    pad is token 0 (what the pad rows compute is never read: see ``prefill_static``)."""
    P = prompt.shape[0]
    B = -(-P // bucket) * bucket
    return (torch.cat([prompt, prompt.new_zeros(B - P)]),
            torch.tensor(P, dtype=torch.long, device=prompt.device))


def prefill_static(target: nn.Module, tokens: torch.Tensor, P: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``eagle3.prefill`` in a fixed shape (``pad_prompt``): tokens [B], the prompt its first P
    -> (state [2]: the first new token and its position P, ``decode_step``'s state; hidden
    [B, 3H], rows past P - 1 the pad's). The pad rows write cache slots P .. B - 1 that no
    query sees before a step writes them anew (a step's queries see the slots below their own
    position and the ones the step itself writes), so a decoding after it is the same."""
    B, dev = tokens.shape[0], tokens.device
    T = kv_caches(target)[0].shape[1]
    pos = torch.arange(B, device=dev)
    causal = torch.arange(T, device=dev)[None, :] <= pos[:, None]
    logits, hidden = target(tokens[None], pos, pos, causal[None, None])
    root = logits[0].index_select(0, (P - 1).view(1)).argmax(-1)  # [1]
    return torch.cat([root, P.view(1)]), hidden[0]


def spec_prefill_static(target: nn.Module, draft: Eagle3Draft, tokens: torch.Tensor,
                        P: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``speculative_generate_static``'s start in a fixed shape: the target's prefill, then the
    draft's over the prompt's pairs (x_{j+1}, h_j) -> (state [pairs + 2], hidden [pairs, 3H]),
    ``spec_step``'s first input. The draft's pad rows (and row P - 1, whose pair has no token
    yet) write draft slots the first step writes again before it reads them."""
    first, hidden = prefill_static(target, tokens, P)
    B, dev = tokens.shape[0], tokens.device
    pos = torch.arange(B, device=dev)
    causal = torch.arange(draft.k_cache.shape[1], device=dev)[None, :] <= pos[:, None]
    draft(torch.cat([tokens[1:], tokens[:1]])[None], draft.fc(hidden[None]), pos, pos,
          causal[None, None])
    state = torch.cat([first[1:], torch.ones_like(first[1:]), first[:1],
                       first.new_zeros(pairs - 1)])
    return state, torch.cat([hidden.index_select(0, (P - 1).view(1)),
                             hidden.new_zeros(pairs - 1, hidden.shape[-1])])


def to_tree(tree_tokens, parents, depth, mask, scores) -> Tree:
    """The ``eagle3.Tree`` of a static tree (for checks: it reads the parents on the host)."""
    return replace(Tree.from_parents(tree_tokens, [-1] + parents[1:].tolist()), scores=scores)


def _check_room(prompt_len: int, max_new_tokens: int, target_slots: int, need: int,
                draft_slots: int, draft_need: int) -> None:
    if prompt_len + max_new_tokens + need > target_slots:
        raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + {need} "
                         f"slots for one step exceed the target KV cache ({target_slots}); call "
                         f"setup_cache with max_seq_len >= {prompt_len + max_new_tokens + need}")
    if draft_slots < target_slots + draft_need:
        raise ValueError(f"the draft KV cache ({draft_slots}) must hold the target's "
                         f"({target_slots}) plus {draft_need} tree slots")


def _padded(prompt: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, P = pad_prompt(prompt)
    if tokens.shape[0] > slots:
        raise ValueError(f"the prompt padded to {tokens.shape[0]} tokens (a multiple of "
                         f"{PREFILL_BUCKET}) exceeds the target KV cache ({slots} slots)")
    return tokens, P


def _sync_step() -> None:
    """A CUDA-graph replay's outputs live until the next replay: mark the step boundary (the
    caller clones what it keeps)."""
    torch.compiler.cudagraph_mark_step_begin()


class HostCopy:
    """A device tensor's values for the host, copied after the work queued so far and read
    later without waiting for work queued after it (the next step). On a CPU, the tensor."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.values = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.values.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))
        else:
            self.values = t

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()


def _step(fn: Callable, *args) -> tuple[tuple[torch.Tensor, ...], HostCopy]:
    """One step launched: its outputs cloned (the replay's own live until the next), and the
    host copy of the first started."""
    _sync_step()
    outs = fn(*args)
    outs = tuple(t.clone() for t in outs) if isinstance(outs, tuple) else (outs.clone(),)
    return outs, HostCopy(outs[0])


class _Steps:
    """A decoding's steps, each launched from the last one's device outputs: ``fn(*args)``
    first, then ``fn(*inputs(outputs))``. ``ahead``: each step is launched before the host
    reads the one before it, so the host's work (the read, the stop test, the next launch)
    runs while the device computes, and after the last step read one more has run, unread
    (its cache writes lie past the tokens kept). Without: launch, read, decide, launch."""

    def __init__(self, fn: Callable, args: tuple, inputs: Callable, ahead: bool):
        self.fn, self.args, self.inputs, self.ahead, self.pending = fn, args, inputs, ahead, None

    def take(self) -> tuple[tuple[torch.Tensor, ...], list]:
        """The next step's device outputs and its first output's values on the host."""
        outs, copy = self.pending or _step(self.fn, *self.args)
        self.args = self.inputs(outs)
        self.pending = _step(self.fn, *self.args) if self.ahead else None
        return outs, copy.tolist()


@torch.no_grad()
def speculative_generate_static(target: nn.Module, draft: Eagle3Draft, prompt: torch.Tensor,
                                max_new_tokens: int, *, spec: TreeSpec,
                                step_fn: Callable = spec_step,
                                stop_tokens: Collection[int] = (),
                                give_up: Callable[[int, int], bool] | None = None,
                                greedy_fn: Callable = decode_step,
                                prefill_fn: Callable | None = None, ahead: bool = False
                                ) -> tuple[list[int], SpecStats]:
    """Greedy EAGLE-3 with ``step_fn`` (``spec_step``, compiled or not): prompt [P] -> (new
    tokens, stats), the same tokens as ``eagle3.speculative_generate``. Both KV caches must be
    set up (once: a compiled step's CUDA graph keeps their addresses).

    ``give_up(steps, tokens)``, asked after each step, True: the rest is decoded by
    ``greedy_fn`` (``decode_step``, compiled or not) from the same cache, the newest token as
    its root: the same tokens (``stats.greedy_from``: the step it fell back after).

    ``prefill_fn`` (``spec_prefill_static`` with ``pairs`` bound, compiled), else the prefill
    runs eagerly in the prompt's own shape. ``ahead``: each step is launched before the host
    reads the last (``_Steps``; the target's cache needs ``spec.pairs`` slots more, for the
    step past the end)."""
    T, P, M = kv_caches(target)[0].shape[1], prompt.shape[0], spec.pairs
    _check_room(P, max_new_tokens, T, spec.total_tokens + (M if ahead else 0),
                draft.k_cache.shape[1], spec.draft_slots())
    if prefill_fn is not None:
        _sync_step()
        state, pairs = (t.clone() for t in prefill_fn(target, draft, *_padded(prompt, T)))
        root = state[2]
    else:
        logits, hidden = prefill(target, prompt)  # [P, V], [P, 3H]
        root = logits[-1].argmax()
        if P > 1:  # the draft sees the prompt's pairs (x_{j+1}, h_j) but the last, eagerly
            pos = torch.arange(P - 1, device=prompt.device)
            causal = (torch.arange(draft.k_cache.shape[1], device=prompt.device)[None, :]
                      <= pos[:, None])
            draft(prompt[None, 1:], draft.fc(hidden[None, :-1]), pos, pos, causal[None, None])
        state = torch.zeros(M + 2, dtype=torch.long, device=prompt.device)
        state[0], state[1], state[2] = P, 1, root
        pairs = hidden.new_zeros(M, hidden.shape[-1])
        pairs[0] = hidden[-1]
    out, stats = [int(root)], SpecStats([])
    steps = _Steps(step_fn, (target, draft, state, pairs, spec),
                   lambda o: (target, draft, *o, spec), ahead)
    while len(out) < max_new_tokens and out[-1] not in stop_tokens:
        _, host = steps.take()  # the step's state: the one host sync of the step
        new = host[2 : 2 + host[1]]
        stats.accepted.append(len(new))
        for t in new:
            out.append(t)
            if t in stop_tokens:
                break
        if (give_up is not None and len(out) < max_new_tokens and out[-1] not in stop_tokens
                and give_up(len(stats.accepted), len(out))):
            stats.greedy_from = len(stats.accepted)
            # the newest token is the root: not in the target's cache, at position L
            g = torch.tensor([out[-1], host[0]], device=prompt.device)
            _greedy_steps(greedy_fn, target, g, out, max_new_tokens, stop_tokens, ahead)
            break
    return out[:max_new_tokens], stats


@torch.no_grad()
def greedy_generate_static(target: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *,
                           step_fn: Callable = decode_step,
                           stop_tokens: Collection[int] = (),
                           prefill_fn: Callable | None = None, ahead: bool = False) -> list[int]:
    """Target-only greedy decoding with ``step_fn`` (``decode_step``, compiled or not), one
    host sync per token for the stop test: the baseline ``speculative_generate_static`` is
    measured against (give both the same ``ahead``: ``_Steps``). ``prefill_fn``:
    ``prefill_static`` (compiled), else an eager prefill."""
    T, P = kv_caches(target)[0].shape[1], prompt.shape[0]
    _check_room(P, max_new_tokens, T, 0, T, 0)
    if prefill_fn is not None:
        _sync_step()
        state = prefill_fn(target, *_padded(prompt, T))[0].clone()
    else:
        logits, _ = prefill(target, prompt)
        state = torch.stack([logits[-1].argmax(), torch.tensor(P, device=prompt.device)])
    out = [int(state[0])]
    _greedy_steps(step_fn, target, state, out, max_new_tokens, stop_tokens, ahead)
    return out


def _greedy_steps(step_fn: Callable, target: nn.Module, state: torch.Tensor, out: list[int],
                  max_new_tokens: int, stop_tokens: Collection[int], ahead: bool) -> None:
    """Greedy steps from ``state`` (token, position), appending to ``out`` to the end."""
    steps = _Steps(step_fn, (target, state), lambda o: (target, *o), ahead)
    while len(out) < max_new_tokens and out[-1] not in stop_tokens:
        out.append(steps.take()[1][0])
