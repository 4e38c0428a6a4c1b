"""EAGLE-3 draft tree against an oracle: the draft layer re-implemented from its definition
(no KV cache, the whole causal sequence recomputed for each new token) and the tree search
re-run from it, node by node.

Greedy speculative decoding reproduces the target whatever the draft proposes, so the other
tests cannot see a wrong draft; these compare what draft_tree proposes, and with which
scores, to what the draft's definition says it should propose.
"""

import pytest
import torch
import torch.nn.functional as F

from fxcoalesce.models import deepseek as ds
from fxcoalesce.models import eagle3 as e3

TINY = ds.CONFIGS["kimi-k2-tiny"]
PROMPT = torch.tensor([1, 5, 7, 3, 2, 9, 4, 300, 17, 41])
TOP_K, DEPTH, TOTAL = 4, 4, 20
DRAFT_VOCAB = 64
# float64 throughout, but rope_angles computes RoPE angles in float32: scores agree to ~1e-7
ATOL = 1e-6
MARGIN = 1e-5  # every top-k and keep decision of the oracle is at least this clear
HINT = 12.0


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class HintedDraft(e3.Eagle3Draft):
    """The draft network plus HINT on the logit of ``hint[token]`` (a draft id) for each input
    token: a draft that often agrees with the target, so that paths get accepted."""

    def forward(self, tokens, *rest):
        logits, hidden = super().forward(tokens, *rest)
        return logits + HINT * F.one_hot(self.hint[tokens], logits.shape[-1]), hidden


def make_draft(draft_vocab: int = DRAFT_VOCAB, hint: torch.Tensor | None = None,
               ) -> tuple[e3.Eagle3Draft, torch.Tensor]:
    """A seeded, peaked draft over ``draft_vocab`` target ids in shuffled order (d2t far from
    zero), RMSNorm weights away from 1 (so that exchanging two norms changes the result);
    a HintedDraft if ``hint`` [target vocab] (the target id to hint after each target id) is
    given. Returns (draft, the target id of each draft id)."""
    gen = torch.Generator().manual_seed(5)
    vocab_ids = torch.randperm(TINY.vocab, generator=gen)[:draft_vocab]
    d2t = vocab_ids - torch.arange(draft_vocab)
    args = e3.DraftArgs.for_target(TINY, draft_vocab=draft_vocab)
    draft = e3.build_draft(args, d2t=d2t, dtype=torch.float64, seed=2)
    if hint is not None:
        draft_id = torch.zeros(TINY.vocab, dtype=torch.long)
        draft_id[vocab_ids] = torch.arange(draft_vocab)
        hinted = HintedDraft(args, d2t)
        hinted.register_buffer("hint", draft_id[hint])
        hinted.load_state_dict(draft.state_dict(), strict=False)
        draft = hinted.double()
    with torch.no_grad():
        draft.lm_head.weight *= 4  # peaked enough that the best paths reach the last level
        for norm in (draft.embed_norm, draft.hidden_norm, draft.ffn_norm, draft.norm):
            norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    return draft, vocab_ids


def rms_norm(x: torch.Tensor, norm: torch.nn.RMSNorm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def reference_step(draft: e3.Eagle3Draft, ids: torch.Tensor, inputs: torch.Tensor):
    """The draft layer by its definition, over a whole sequence at positions 0..s-1 with no
    cache: ids [s] target ids, inputs [s, H] hidden inputs -> (log-probs [Vd], output hidden
    [H]) at the last position. A HintedDraft's hint is added to the logits."""
    a, d = draft.args, draft
    s, hd = ids.shape[0], a.dim // a.n_heads
    x = torch.cat([rms_norm(d.embed.weight[ids], d.embed_norm),
                   rms_norm(inputs, d.hidden_norm)], -1)  # [s, 2H]
    q, k, v = (x @ w.weight.T for w in (d.wq, d.wk, d.wv))
    q, k, v = (t.view(s, a.n_heads, hd).transpose(0, 1) for t in (q, k, v))  # [h, s, hd]
    freq = a.rope_theta ** -(torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * freq  # [s, hd/2]
    cos, sin = angles.cos(), angles.sin()

    def rotate(t):  # pairs (t[i], t[i + hd/2])
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

    att = rotate(q) @ rotate(k).transpose(1, 2) / hd**0.5  # [h, s, s]
    att = att.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    h = inputs + (att.softmax(-1) @ v).transpose(0, 1).reshape(s, -1) @ d.wo.weight.T
    f = rms_norm(h, d.ffn_norm)
    h = h + (F.silu(f @ d.w1.weight.T) * (f @ d.w3.weight.T)) @ d.w2.weight.T
    logits = rms_norm(h[-1], d.norm) @ d.lm_head.weight.T
    if isinstance(draft, HintedDraft):
        logits[draft.hint[ids[-1]]] += HINT
    return logits.log_softmax(-1), h[-1]


def reference_logprobs(draft, tokens, hidden, path) -> torch.Tensor:
    """Draft log-probs [Vd] after the root and then the target ids ``path`` below it, decoded
    one token at a time from scratch: the pairs (tokens [n], fc(hidden) [n, H]), then each
    path token with the draft's own previous output as its hidden input."""
    ids, inputs = tokens, hidden @ draft.fc.weight.T
    logp, out = reference_step(draft, ids, inputs)
    for t in path:
        ids, inputs = torch.cat([ids, torch.tensor([t])]), torch.cat([inputs, out[None]])
        logp, out = reference_step(draft, ids, inputs)
    return logp


def assert_separated(values: torch.Tensor, n: int) -> None:
    """The n-th and (n+1)-th largest of ``values`` differ by more than MARGIN, so choosing the
    top n does not hinge on rounding."""
    if n < values.numel():
        top = values.topk(n + 1).values
        assert top[n - 1] - top[n] > MARGIN, float(top[n - 1] - top[n])


def oracle_search(draft, vocab_ids, tokens, hidden) -> dict[tuple[int, ...], float]:
    """Every candidate draft_tree's docstring says it drafts, as {target-id path below the
    root: cumulative log-prob}: each level expands the TOP_K best candidates of the previous
    level (the root first) into their TOP_K most likely tokens."""
    candidates: dict[tuple[int, ...], float] = {}
    frontier = [()]
    for _ in range(DEPTH):
        level = {}
        for path in frontier:
            logp = reference_logprobs(draft, tokens, hidden, path)
            assert_separated(logp, TOP_K)
            best = logp.topk(TOP_K)
            for lp, i in zip(best.values.tolist(), best.indices.tolist()):
                level[path + (int(vocab_ids[i]),)] = candidates.get(path, 0.0) + lp
        candidates |= level
        assert_separated(torch.tensor(list(level.values()), dtype=torch.float64), TOP_K)
        frontier = sorted(level, key=level.get, reverse=True)[:TOP_K]
    return candidates


def tree_paths(tree: e3.Tree) -> list[tuple[int, ...]]:
    """The target ids on the path from the root to each node (the root's own path is ())."""
    paths: list[tuple[int, ...]] = [()]
    for i, p in enumerate(tree.parents.tolist()[1:], 1):
        paths.append(paths[p] + (int(tree.tokens[i]),))
    return paths


def check_against_oracle(tree, draft, vocab_ids, tokens, hidden) -> None:
    candidates = oracle_search(draft, vocab_ids, tokens, hidden)
    paths = tree_paths(tree)
    assert tree.tokens[0] == tokens[-1] and tree.scores[0] == 0
    # (a) every kept node is one of its parent's top-k tokens under the oracle
    assert all(p in candidates for p in paths[1:]), [p for p in paths[1:] if p not in candidates]
    # (b) its score is the oracle's cumulative log-prob of its path
    torch.testing.assert_close(tree.scores[1:], torch.tensor([candidates[p] for p in paths[1:]],
                                                             dtype=torch.float64),
                               rtol=0, atol=ATOL)
    # (c) the kept nodes are the best TOTAL - 1 of all candidates
    assert_separated(torch.tensor(list(candidates.values()), dtype=torch.float64), TOTAL - 1)
    best = sorted(candidates, key=candidates.get, reverse=True)[: TOTAL - 1]
    assert sorted(paths[1:]) == sorted(best)
    # children in draft order, best first (accept_sampling tries them in that order)
    for kids in tree.children():
        assert tree.scores[kids].tolist() == sorted(tree.scores[kids].tolist(), reverse=True)


@torch.no_grad()
def test_draft_tree_matches_oracle_across_two_steps():
    """Fails if, in Eagle3Draft.forward: cat(hidden, embed) instead of cat(embed, hidden);
    hidden_norm dropped, or embed_norm applied to the hidden; the residual taken from the
    normed hidden; the final norm dropped, or applied to the returned hidden; RoPE at
    cache_pos; k or v written at input_pos or at cache_pos + 1; to_target ignoring d2t.
    In draft_tree: the prefix pairs or the tree levels at positions one off; the first level
    read from logits[0, 0]; the next level expanded from another node's hidden
    (``out[0, best % top_k]``, ``out[0]``, the root's); draft ids fed back or emitted without
    d2t; the tree mask hiding the last prefix slot, showing a node its siblings or hiding its
    parent; a frontier of each parent's best child, or ranked by last-step log-prob; nodes
    kept in pool order instead of by score. (RoPE shifted by one for every position is not
    caught: attention only sees position differences.)

    The second draft_tree call reuses the draft cache of the first, as speculative_generate
    does: the prefix written then, the first tree's stale entries past it."""
    target = ds.build(TINY, dtype=torch.float64)
    target.setup_cache(1, 32)
    logits, hidden = e3.prefill(target, PROMPT)  # hidden [P, 3H]: h_0 .. h_{P-1}
    pairs = torch.cat([PROMPT[1:], logits[-1:].argmax(-1)])  # x_1 .. x_P
    draft, vocab_ids = make_draft()
    draft.setup_cache(64)
    for start, stop in ((0, 6), (6, len(PROMPT))):
        tree = e3.draft_tree(draft, pairs[start:stop], hidden[start:stop], stop, top_k=TOP_K,
                             depth=DEPTH, total_tokens=TOTAL)
        assert int(tree.depth.max()) == DEPTH  # the deepest level is reached and kept
        check_against_oracle(tree, draft, vocab_ids, pairs[:stop], hidden[:stop])


@torch.no_grad()
def test_drafts_during_speculative_decoding_match_oracle(monkeypatch):
    """Fails for every draft bug listed in the test above, and if speculative_generate feeds
    the draft the wrong hidden states after an accepted path (those of the first nodes instead
    of the path's, or the last one repeated). Every tree drafted while generating must be the
    oracle's tree for the whole sequence so far, with the target's hidden states recomputed
    by one prefill."""
    target = ds.build(TINY, dtype=torch.float64)
    target.setup_cache(1, 96)
    want = e3.greedy_generate(target, PROMPT, 24)
    seq = torch.cat([PROMPT, want])
    hint = torch.zeros(TINY.vocab, dtype=torch.long)
    hint[seq[:-1]] = seq[1:]
    draft, vocab_ids = make_draft(TINY.vocab, hint)
    trees, draft_tree = [], e3.draft_tree

    def recording_draft_tree(draft, tokens, hidden, prefix_len, **kwargs):
        trees.append((prefix_len, draft_tree(draft, tokens, hidden, prefix_len, **kwargs)))
        return trees[-1][1]

    monkeypatch.setattr(e3, "draft_tree", recording_draft_tree)
    got, stats = e3.speculative_generate(target, draft, PROMPT, 24, top_k=TOP_K, depth=DEPTH,
                                         total_tokens=TOTAL)
    assert torch.equal(got, want)
    assert max(stats.accepted) > 2 and min(stats.accepted) == 1, stats.accepted  # both happen
    target.setup_cache(1, 96)
    _, hidden = e3.prefill(target, seq)
    for L, tree in trees:
        check_against_oracle(tree, draft, vocab_ids, seq[1 : L + 1], hidden[:L])


def test_rope_table_gathers_what_rope_angles_computes():
    """The target and the draft gather RoPE's cos/sin from a table of positions 0..T-1
    (``rope.rope_table``, made by ``setup_cache``) instead of computing them per step: the
    same values, bit for bit, at any position in the table."""
    from fxcoalesce.models.rope import rope_angles, rope_table

    pos = torch.tensor([0, 5, 63, 64, 200, 255])
    for dtype in (torch.float32, torch.float64):
        cos, sin = rope_table(256, 64, 100000.0, dtype)
        want = rope_angles(pos, 64, 100000.0, dtype)
        assert torch.equal(cos[pos], want[0]) and torch.equal(sin[pos], want[1])
