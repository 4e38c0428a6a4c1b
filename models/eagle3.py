"""EAGLE-3 speculative decoding: draft head, tree drafting, one-forward tree verification,
greedy and sampling acceptance, KV commit (algorithm of SafeAILab/EAGLE, gpt-fast style).

The target is any module with ``setup_cache`` and
``forward(tokens [B, S], input_pos [S], cache_pos [S], mask [B|1, 1, S, T]) -> (logits, hidden)``
whose KV caches are buffers named ``*_cache`` with the sequence on dim 1 (``models.deepseek``).

One speculative step, with L tokens committed to the target's cache and the root r (the last
sampled token) not yet in it:

    draft_tree:   the draft consumes (token, target hidden) pairs up to position L - 1, then
                  expands a top-k tree below r for ``depth`` levels           -> Tree of N nodes
    verify_step:  one target forward of the N nodes at positions L + depth, cache slots L..L+N-1
    accept_*:     longest agreeing root-to-leaf path + one bonus token from the target
    commit_kv:    move the path's KV entries to slots L.., so L grows by the path length
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Collection, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .rope import rope_half, rope_table


@dataclass(kw_only=True, frozen=True)
class DraftArgs:
    dim: int
    """Hidden size; equals the target's (fc maps its 3 captured states, 3 * dim, to dim)."""
    n_heads: int
    """Attention heads of the draft layer."""
    inter_dim: int
    """SwiGLU FFN size of the draft layer."""
    draft_vocab: int
    """Size of the draft's reduced output vocabulary."""
    target_vocab: int
    """Size of the target vocabulary (the draft's input embedding covers all of it)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base of the draft attention."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"n_heads ({self.n_heads}) must divide dim ({self.dim}) into even "
                             f"head dims")
        if not 1 <= self.draft_vocab <= self.target_vocab:
            raise ValueError(f"draft_vocab ({self.draft_vocab}) must be in [1, target_vocab "
                             f"({self.target_vocab})]")

    @classmethod
    def for_target(cls, target_args, *, draft_vocab: int | None = None) -> DraftArgs:
        """Draft sized like the target (``dim``, ``n_heads``, ``inter_dim``, ``vocab`` fields)."""
        return cls(dim=target_args.dim, n_heads=target_args.n_heads,
                   inter_dim=target_args.inter_dim, draft_vocab=draft_vocab or target_args.vocab,
                   target_vocab=target_args.vocab, norm_eps=target_args.norm_eps)


def check_d2t(d2t: torch.Tensor, draft_vocab: int, target_vocab: int) -> None:
    """d2t [draft_vocab] must map draft ids one-to-one into the target vocabulary."""
    if d2t.shape != (draft_vocab,) or d2t.is_floating_point():
        raise ValueError(f"d2t must be an integer tensor of shape ({draft_vocab},), "
                         f"got {d2t.dtype} {tuple(d2t.shape)}")
    ids = torch.arange(draft_vocab, device=d2t.device) + d2t
    bad = ((ids < 0) | (ids >= target_vocab)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"d2t maps draft ids {bad[:5].tolist()} outside the target vocabulary "
                         f"[0, {target_vocab}); every i + d2t[i] must be a target id: rebuild d2t "
                         f"as target_id[i] - i from the draft vocabulary's target ids")
    if ids.unique().numel() != draft_vocab:
        raise ValueError("d2t maps several draft ids to the same target id; the draft vocabulary "
                         "must be distinct target ids (d2t[i] = target_id[i] - i)")


class Eagle3Draft(nn.Module):
    """One decoder layer over cat(norm(embed(token)), norm(hidden)) (2H), replicated on every
    TP rank. Its output hidden state (before the final norm) feeds the next draft step."""

    def __init__(self, args: DraftArgs, d2t: torch.Tensor | None = None):
        super().__init__()
        self.args = args
        H, hd = args.dim, args.dim // args.n_heads
        self.embed = nn.Embedding(args.target_vocab, H)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.embed_norm = nn.RMSNorm(H, eps=args.norm_eps)
        self.hidden_norm = nn.RMSNorm(H, eps=args.norm_eps)
        self.wq = nn.Linear(2 * H, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(2 * H, args.n_heads * hd, bias=False)
        self.wv = nn.Linear(2 * H, args.n_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, H, bias=False)
        self.ffn_norm = nn.RMSNorm(H, eps=args.norm_eps)
        self.w1 = nn.Linear(H, args.inter_dim, bias=False)
        self.w2 = nn.Linear(args.inter_dim, H, bias=False)
        self.w3 = nn.Linear(H, args.inter_dim, bias=False)
        self.norm = nn.RMSNorm(H, eps=args.norm_eps)
        self.lm_head = nn.Linear(H, args.draft_vocab, bias=False)
        if d2t is None:
            d2t = torch.zeros(args.draft_vocab, dtype=torch.long)
        check_d2t(d2t, args.draft_vocab, args.target_vocab)
        self.register_buffer("d2t", d2t)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.register_buffer("rope_cos", None, persistent=False)  # [T, d/2]: setup_cache
        self.register_buffer("rope_sin", None, persistent=False)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target vocabulary ids."""
        return ids + self.d2t[ids]

    def setup_cache(self, max_seq_len: int, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> None:
        shape = (1, max_seq_len, self.args.n_heads, self.args.dim // self.args.n_heads)
        dtype, device = dtype or self.fc.weight.dtype, device or self.fc.weight.device
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.rope_cos, self.rope_sin = rope_table(max_seq_len, shape[-1], self.args.rope_theta,
                                                  torch.promote_types(dtype, torch.float32),
                                                  device)

    def forward(self, tokens, hidden, input_pos, cache_pos, mask):
        """tokens [1, S] target ids; hidden [1, S, H] (``fc`` of the target's 3H states, or the
        draft's own output); mask [1, 1, S, T] -> draft logits [1, S, Vd], hidden [1, S, H]."""
        B, S, H = hidden.shape
        x = torch.cat([self.embed_norm(self.embed(tokens)), self.hidden_norm(hidden)], -1)  # 2H
        q, k, v = (w(x).view(B, S, self.args.n_heads, -1) for w in (self.wq, self.wk, self.wv))
        rot_dtype = torch.promote_types(q.dtype, torch.float32)
        cos, sin = (t[input_pos].to(rot_dtype) for t in (self.rope_cos, self.rope_sin))
        q, k = (rope_half(t, cos[:, None], sin[:, None]) for t in (q, k))
        self.k_cache.index_copy_(1, cache_pos, k)
        self.v_cache.index_copy_(1, cache_pos, v)
        k_all, v_all = self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)  # [B, h, T, d]
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask)
        h = hidden + self.wo(attn.transpose(1, 2).flatten(2))
        x = self.ffn_norm(h)
        h = h + self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.lm_head(self.norm(h)), h


def build_draft(args: DraftArgs, *, d2t: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                seed: int = 0) -> Eagle3Draft:
    """Draft with seeded N(0, 1/fan_in) matrices (norm weights 1)."""
    draft = Eagle3Draft(args, d2t).to(device)
    gen = torch.Generator(device=draft.fc.weight.device).manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return draft.to(dtype)


@dataclass
class Tree:
    tokens: torch.Tensor
    """[N] target token ids; node 0 is the root (the last sampled token)."""
    parents: torch.Tensor
    """[N] parent node of each node, -1 for the root; parents come before their children."""
    depth: torch.Tensor
    """[N] distance from the root; positions are prefix_len + depth."""
    mask: torch.Tensor
    """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
    retrieve_indices: torch.Tensor
    """[n_leaves, max_depth + 1] root-to-leaf node paths, leaves in node order, -1 padded."""
    scores: torch.Tensor | None = None
    """[N] cumulative draft log-prob of each node (0 at the root); None unless drafted."""

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: Sequence[int]) -> Tree:
        """The tree with node i's parent ``parents[i]`` and token ``tokens[i]``."""
        N = len(parents)
        ordered = all(0 <= p < i for i, p in enumerate(parents[1:], 1))
        if tokens.shape != (N,) or parents[0] != -1 or not ordered:
            raise ValueError("a tree needs tokens [N] and parents[0] == -1, 0 <= parents[i] < i")
        depth, mask, paths = [0], torch.eye(N, dtype=torch.bool), [[0]]
        for i, p in enumerate(parents[1:], 1):
            depth.append(depth[p] + 1)
            mask[i] |= mask[p]
            paths.append(paths[p] + [i])
        leaves = sorted(set(range(N)) - set(parents))
        width = max(depth) + 1
        retrieve = [paths[i] + [-1] * (width - len(paths[i])) for i in leaves]
        dev = tokens.device
        return cls(tokens, torch.tensor(parents, device=dev), torch.tensor(depth, device=dev),
                   mask.to(dev), torch.tensor(retrieve, device=dev))

    def children(self) -> list[list[int]]:
        """Children of each node in node order (for drafted trees: best draft score first)."""
        kids: list[list[int]] = [[] for _ in range(self.tokens.shape[0])]
        for i, p in enumerate(self.parents.tolist()[1:], 1):
            kids[p].append(i)
        return kids


def kv_caches(model: nn.Module) -> list[torch.Tensor]:
    """The target's KV cache buffers (named ``*_cache``, sequence on dim 1)."""
    caches = [b for name, b in model.named_buffers() if name.endswith("_cache")]
    if not caches:
        raise ValueError("the target has no KV cache: call setup_cache() first")
    return caches


def visible_mask(prefix_len: int, block: torch.Tensor, cache_len: int) -> torch.Tensor:
    """[1, 1, n, cache_len] bool: n new tokens written at slots prefix_len.. see the whole
    prefix and, among themselves, what ``block`` [n, n] allows."""
    n = block.shape[0]
    if prefix_len + n > cache_len:
        raise ValueError(f"{prefix_len} cached + {n} new tokens exceed the KV cache of "
                         f"{cache_len} slots; call setup_cache with a larger max_seq_len or "
                         f"generate fewer tokens")
    mask = torch.zeros(n, cache_len, dtype=torch.bool, device=block.device)
    mask[:, :prefix_len] = True
    mask[:, prefix_len : prefix_len + n] = block
    return mask[None, None]


def tree_verify_inputs(tree: Tree, prefix_len: int, cache_len: int):
    """(input_pos [N], cache_pos [N], mask [1, 1, N, cache_len]) for verifying ``tree``."""
    N = tree.tokens.shape[0]
    cache_pos = torch.arange(prefix_len, prefix_len + N, device=tree.tokens.device)
    return prefix_len + tree.depth, cache_pos, visible_mask(prefix_len, tree.mask, cache_len)


def verify_step(model: nn.Module, tokens: torch.Tensor, input_pos: torch.Tensor,
                cache_pos: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over all N tree tokens [1, N] -> (logits [1, N, V], hidden [1, N, 3H]).
    Free of host syncs, for ``torch.compile(verify_step, fullgraph=True)``."""
    return model(tokens, input_pos, cache_pos, mask)


@torch.no_grad()
def draft_tree(draft: Eagle3Draft, tokens: torch.Tensor, hidden: torch.Tensor, prefix_len: int, *,
               top_k: int, depth: int, total_tokens: int) -> Tree:
    """Draft a tree of ``total_tokens`` nodes below the root ``tokens[-1]``.

    tokens [n] target ids and hidden [n, 3H] target states are the pairs (x_{j+1}, h_j) for
    positions j = prefix_len - n .. prefix_len - 1 not yet seen by the draft. Each level expands
    the ``top_k`` best nodes by cumulative draft log-prob into ``top_k`` children each; the best
    ``total_tokens - 1`` of all drafted nodes (ties to the earlier node, so ancestors come first)
    are kept with the root.
    """
    n, T = tokens.shape[0], draft.k_cache.shape[1]
    most = 1 + top_k + (depth - 1) * top_k**2  # root + every drafted node
    if top_k > draft.args.draft_vocab or not 1 < total_tokens <= most:
        raise ValueError(f"total_tokens ({total_tokens}) must be in [2, {most}] for top_k={top_k}, "
                         f"depth={depth} (and top_k <= draft_vocab)")
    if prefix_len + (depth - 1) * top_k > T:
        raise ValueError(f"the draft KV cache ({T}) cannot hold {prefix_len} tokens plus the tree; "
                         f"call draft.setup_cache with a larger max_seq_len")
    dev = tokens.device
    pos = torch.arange(prefix_len - n, prefix_len, device=dev)
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    mask = visible_mask(prefix_len - n, causal, T)
    logits, out = draft(tokens[None], draft.fc(hidden[None]), pos, pos, mask)
    scores, ids = logits[0, -1].log_softmax(-1).topk(top_k)  # [k]
    pool_ids, pool_scores, pool_parents = [ids], [scores], [torch.full((top_k,), -1, device=dev)]
    frontier = torch.arange(top_k, device=dev)  # pool indices of the nodes to expand
    frontier_hidden = out[0, -1].expand(top_k, -1)  # [k, H] draft state of their parents
    ancestors: list[list[int]] = [[] for _ in range(top_k)]  # their ancestors' draft cache slots
    for d in range(1, depth):
        slots = list(range(prefix_len + (d - 1) * top_k, prefix_len + d * top_k))
        mask = torch.zeros(top_k, T, dtype=torch.bool, device=dev)  # prefix + ancestors + itself
        mask[:, :prefix_len] = True
        for j, anc in enumerate(ancestors):
            mask[j, anc + [slots[j]]] = True
        flat_ids, flat_scores = torch.cat(pool_ids), torch.cat(pool_scores)
        node_tokens = draft.to_target(flat_ids[frontier])  # [k]
        pos = torch.full((top_k,), prefix_len - 1 + d, device=dev)
        logits, out = draft(node_tokens[None], frontier_hidden[None], pos,
                            torch.tensor(slots, device=dev), mask[None, None])
        child_scores, child_ids = logits[0].log_softmax(-1).topk(top_k)  # [k, k]
        child_scores = flat_scores[frontier][:, None] + child_scores
        base = flat_ids.shape[0]
        pool_ids.append(child_ids.flatten())
        pool_scores.append(child_scores.flatten())
        pool_parents.append(frontier.repeat_interleave(top_k))
        best = child_scores.flatten().topk(top_k).indices  # [k]
        parent = best // top_k
        frontier, frontier_hidden = base + best, out[0, parent]
        ancestors = [ancestors[p] + [slots[p]] for p in parent.tolist()]
    all_scores = torch.cat(pool_scores)
    order = torch.sort(all_scores, descending=True, stable=True).indices
    keep = order[: total_tokens - 1].sort().values.tolist()
    node_of = {-1: 0} | {p: i for i, p in enumerate(keep, 1)}  # pool index -> node (-1: root)
    pool_parent = torch.cat(pool_parents).tolist()
    parents = [-1] + [node_of[pool_parent[p]] for p in keep]
    keep_t = torch.tensor(keep, device=dev)
    tree_tokens = torch.cat([tokens[-1:], draft.to_target(torch.cat(pool_ids)[keep_t])])
    scores = torch.cat([all_scores.new_zeros(1), all_scores[keep_t]])
    return replace(Tree.from_parents(tree_tokens, parents), scores=scores)


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (tokens [n + 1]: the longest root-to-leaf path whose every token is the
    target's argmax after its parent, plus the target's bonus token; path [n + 1] node indices)."""
    pred = logits.argmax(-1)  # [N]
    paths = tree.retrieve_indices  # [P, D + 1]
    child, parent = paths[:, 1:], paths[:, :-1]
    match = (child >= 0) & (tree.tokens[child.clamp(min=0)] == pred[parent.clamp(min=0)])
    n_accepted = match.long().cumprod(1).sum(1)  # [P]
    best = int(n_accepted.argmax())
    path = paths[best, : int(n_accepted[best]) + 1]
    return torch.cat([tree.tokens[path[1:]], pred[path[-1:]]]), path


def accept_sampling(tree: Tree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling; target_probs [N, V] -> (tokens [n + 1], path [n + 1]).

    At each node the children are tried in order; child x is accepted with probability p(x) of
    the current residual p, else p(x) is zeroed (renormalised implicitly); when all are rejected
    the bonus token is drawn from the residual. The tree's proposals are deterministic (top-k),
    i.e. q is a point mass, so min(1, p/q) = p(x) and each emitted token is distributed exactly
    as the target's p.
    """
    kids = tree.children()
    node, path, out = 0, [0], []
    while True:
        p = target_probs[node].clone()  # [V]
        accepted = None
        for c in kids[node]:
            x = tree.tokens[c]
            if torch.rand((), generator=generator, device=p.device) * p.sum() < p[x]:
                accepted = c
                break
            p[x] = 0
        if accepted is None:
            out.append(torch.multinomial(p, 1, generator=generator)[0])
            return torch.stack(out), torch.tensor(path, device=p.device)
        out.append(tree.tokens[accepted])
        path.append(accepted)
        node = accepted


def commit_kv(model: nn.Module, prefix_len: int, slots: torch.Tensor) -> int:
    """Copy the KV entries at cache ``slots`` [n] (the accepted path, ascending) to slots
    prefix_len .. prefix_len + n - 1 of every cache; returns the new committed length."""
    dst = torch.arange(prefix_len, prefix_len + slots.numel(), device=slots.device)
    for cache in kv_caches(model):
        cache.index_copy_(1, dst, cache.index_select(1, slots))
    return prefix_len + slots.numel()


@torch.no_grad()
def prefill(target: nn.Module, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the target's cache with ``prompt`` [P] -> (logits [P, V], hidden [P, 3H])."""
    P = prompt.shape[0]
    pos = torch.arange(P, device=prompt.device)
    causal = torch.ones(P, P, dtype=torch.bool, device=prompt.device).tril()
    mask = visible_mask(0, causal, kv_caches(target)[0].shape[1])
    logits, hidden = target(prompt[None], pos, pos, mask)
    return logits[0], hidden[0]


def cut_at_stop(tokens: torch.Tensor, stop_tokens: Collection[int]) -> torch.Tensor:
    """``tokens`` [n] up to and including the first of ``stop_tokens`` (all if none is there)."""
    hits = [i for i, t in enumerate(tokens.tolist()) if t in stop_tokens]
    return tokens[: hits[0] + 1] if hits else tokens


@torch.no_grad()
def greedy_generate(target: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *,
                    stop_tokens: Collection[int] = ()) -> torch.Tensor:
    """Plain autoregressive greedy decoding: prompt [P] -> new tokens [max_new_tokens], or
    fewer, ending with the first of ``stop_tokens`` generated (e.g. EOS)."""
    T, P = kv_caches(target)[0].shape[1], prompt.shape[0]
    logits, _ = prefill(target, prompt)
    out = [logits[-1].argmax()]
    one = torch.ones(1, 1, dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens - 1):
        if stop_tokens and int(out[-1]) in stop_tokens:
            break
        pos = torch.tensor([P + i], device=prompt.device)
        logits, _ = target(out[-1].view(1, 1), pos, pos, visible_mask(P + i, one, T))
        out.append(logits[0, -1].argmax())
    return torch.stack(out)


@dataclass
class SpecStats:
    accepted: list[int]
    """Tokens emitted by each verify step (accepted draft tokens + 1 bonus)."""
    greedy_from: int | None = None
    """The step after which greedy decoding took over (``give_up``), None: it never did."""

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)


@torch.no_grad()
def speculative_generate(target: nn.Module, draft: Eagle3Draft, prompt: torch.Tensor,
                         max_new_tokens: int, *, verify_fn: Callable = verify_step, top_k: int = 8,
                         depth: int = 5, total_tokens: int = 60, greedy: bool = True,
                         temperature: float = 1.0, generator: torch.Generator | None = None,
                         stop_tokens: Collection[int] = (),
                         ) -> tuple[torch.Tensor, SpecStats]:
    """EAGLE-3 decoding: prompt [P] -> (new tokens [max_new_tokens], stats); fewer tokens when
    one of ``stop_tokens`` (e.g. EOS) is generated, ending with it. Sampling at temperature 0
    is greedy decoding. Every verify has exactly ``total_tokens`` tokens, so a compiled
    ``verify_fn`` compiles once. Under TP every rank runs this with the same draft weights
    (and the same ``generator`` seed if sampling)."""
    greedy = greedy or temperature == 0
    T, P = kv_caches(target)[0].shape[1], prompt.shape[0]
    if P + max_new_tokens + total_tokens > T:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) + total_tokens "
                         f"({total_tokens}) exceed the target KV cache ({T}); call setup_cache "
                         f"with max_seq_len >= {P + max_new_tokens + total_tokens}")

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [V] -> []
        if greedy:
            return logits.argmax()
        return torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[0]

    logits, hidden = prefill(target, prompt)
    draft.setup_cache(T + depth * top_k, hidden.dtype, hidden.device)
    root = pick(logits[-1]).view(1)
    out, L, stats = [root], P, SpecStats([])
    tokens = torch.cat([prompt[1:], root])  # pairs (x_{j+1}, h_j) the draft has not seen
    stopped = bool(stop_tokens) and int(root) in stop_tokens
    while not stopped and sum(stats.accepted) + 1 < max_new_tokens:
        tree = draft_tree(draft, tokens, hidden, L, top_k=top_k, depth=depth,
                          total_tokens=total_tokens)
        input_pos, cache_pos, mask = tree_verify_inputs(tree, L, T)
        logits, tree_hidden = verify_fn(target, tree.tokens[None], input_pos, cache_pos, mask)
        if greedy:
            tokens, path = accept_greedy(tree, logits[0])
        else:
            tokens, path = accept_sampling(tree, (logits[0] / temperature).softmax(-1), generator)
        L = commit_kv(target, L, cache_pos[path])
        hidden = tree_hidden[0, path]
        out.append(tokens)
        stats.accepted.append(len(tokens))
        stopped = bool(stop_tokens) and bool(set(tokens.tolist()) & set(stop_tokens))
    return cut_at_stop(torch.cat(out)[:max_new_tokens], stop_tokens), stats
