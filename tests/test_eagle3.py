"""EAGLE-3: tree bookkeeping, acceptance rules, KV commit, and speculative decoding that
reproduces the target's own greedy tokens at TP 1 and over 2 gloo ranks."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxcoalesce
from fxcoalesce.apps.launch import spawn
from fxcoalesce.models import deepseek as ds
from fxcoalesce.models import eagle3 as e3

# a 32-token vocabulary lets the random draft hit the target often enough to accept long paths
SMALL_VOCAB = replace(ds.CONFIGS["kimi-k2-tiny"], vocab=32)
PROMPT = torch.tensor([1, 5, 7, 3, 2, 9, 4])


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def hand_tree() -> e3.Tree:
    """      0:10
           /      \\
        1:11      2:12
        /   \\       \\
     3:13  4:14    5:15
      |
     6:16                    (node:token)"""
    return e3.Tree.from_parents(torch.arange(10, 17), [-1, 0, 0, 1, 1, 2, 3])


def test_tree_mask_positions_retrieve_indices():
    tree = hand_tree()
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert tree.retrieve_indices.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert tree.children() == [[1, 2], [3, 4], [5], [6], [], [], []]

    input_pos, cache_pos, mask = e3.tree_verify_inputs(tree, prefix_len=5, cache_len=16)
    assert input_pos.tolist() == [5, 6, 6, 7, 7, 7, 8]
    assert cache_pos.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert mask.shape == (1, 1, 7, 16)
    assert mask[0, 0, :, :5].all() and not mask[0, 0, :, 12:].any()
    assert torch.equal(mask[0, 0, :, 5:12], tree.mask)


def test_tree_rejects_bad_parents_and_cache_overflow():
    with pytest.raises(ValueError, match="parents"):
        e3.Tree.from_parents(torch.arange(3), [-1, 2, 0])
    with pytest.raises(ValueError, match="exceed the KV cache of 16"):
        e3.tree_verify_inputs(hand_tree(), prefix_len=10, cache_len=16)


def logits_with_argmax(winners: dict[int, int], n: int = 7, vocab: int = 20) -> torch.Tensor:
    logits = torch.zeros(n, vocab)
    for node, token in winners.items():
        logits[node, token] = 1.0
    return logits


@pytest.mark.parametrize("winners, tokens, path", [
    ({0: 11, 1: 13, 3: 16, 6: 19}, [11, 13, 16, 19], [0, 1, 3, 6]),  # the deepest path + bonus
    ({0: 11, 1: 14, 4: 2}, [11, 14, 2], [0, 1, 4]),
    ({0: 12, 2: 7}, [12, 7], [0, 2]),  # node 2's only child (15) is not the argmax
    ({0: 3}, [3], [0]),  # no draft token accepted: just the bonus
])
def test_accept_greedy(winners, tokens, path):
    got_tokens, got_path = e3.accept_greedy(hand_tree(), logits_with_argmax(winners))
    assert got_tokens.tolist() == tokens and got_path.tolist() == path


def test_commit_kv_moves_accepted_entries():
    model = nn.Module()
    model.register_buffer("kv_cache", torch.arange(20.0).view(1, 10, 2))
    before = model.kv_cache.clone()
    assert e3.commit_kv(model, 3, torch.tensor([3, 5, 8])) == 6
    assert torch.equal(model.kv_cache[0, 3:6], before[0, [3, 5, 8]])
    assert torch.equal(model.kv_cache[0, :3], before[0, :3])
    assert torch.equal(model.kv_cache[0, 6:], before[0, 6:])


# ---- sampling acceptance keeps the target distribution ----------------------------------

P_ROOT = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
P_NODE1 = torch.tensor([0.05, 0.10, 0.40, 0.15, 0.20, 0.10])


def sampling_setup() -> tuple[e3.Tree, torch.Tensor]:
    """Root -> candidates 1, 0, 3 (in draft order); candidate 1 -> candidates 2, 4."""
    tree = e3.Tree.from_parents(torch.tensor([5, 1, 0, 3, 2, 4]), [-1, 0, 0, 0, 1, 1])
    probs = torch.stack([P_ROOT, P_NODE1] + [torch.full((6,), 1 / 6)] * 4)
    return tree, probs


def accept_first_candidate(tree, probs, generator):
    """Wrong: the draft's first candidate is always accepted."""
    return tree.tokens[1:2], torch.tensor([0, 1])


def accept_without_renormalising(tree, probs, generator):
    """Wrong: candidate x accepted with the ORIGINAL p(x), not that of the residual."""
    p = probs[0].clone()
    for c in tree.children()[0]:
        x = tree.tokens[c]
        if torch.rand((), generator=generator) < probs[0, x]:
            return tree.tokens[c : c + 1], torch.tensor([0, c])
        p[x] = 0
    return torch.multinomial(p, 1, generator=generator), torch.tensor([0])


def emitted_counts(accept, trials: int = 12000):
    """Counts of the first emitted token, and of the second when the first is candidate 1."""
    tree, probs = sampling_setup()
    generator = torch.Generator().manual_seed(0)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(trials):
        tokens, _ = accept(tree, probs, generator)
        first[tokens[0]] += 1
        if tokens[0] == 1 and len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


# 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5 under the right distribution
CHI2_LIMIT = 30.0


def test_accept_sampling_preserves_target_distribution():
    first, second = emitted_counts(e3.accept_sampling)
    assert second.sum() == first[1]  # an accepted candidate is always followed by a token
    assert chi_square(first, P_ROOT) < CHI2_LIMIT
    assert chi_square(second, P_NODE1) < CHI2_LIMIT


@pytest.mark.parametrize("wrong_rule", [accept_first_candidate, accept_without_renormalising])
def test_distribution_check_catches_wrong_rules(wrong_rule):
    first, _ = emitted_counts(wrong_rule, trials=4000)
    assert chi_square(first, P_ROOT) > 5 * CHI2_LIMIT


# ---- draft ------------------------------------------------------------------------------


def test_d2t_validation():
    args = e3.DraftArgs(dim=16, n_heads=2, inter_dim=32, draft_vocab=4, target_vocab=10)
    draft = e3.Eagle3Draft(args, torch.tensor([0, 2, 5, 6]))
    assert draft.to_target(torch.arange(4)).tolist() == [0, 3, 7, 9]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        e3.Eagle3Draft(args, torch.tensor([0, 2, 5, 7]))  # 3 + 7 = 10 is not a target id
    with pytest.raises(ValueError, match="same target id"):
        e3.Eagle3Draft(args, torch.tensor([1, 0, 0, 0]))  # draft 0 and 1 both map to target 1
    with pytest.raises(ValueError, match="shape"):
        e3.Eagle3Draft(args, torch.tensor([0, 0, 0]))


def make_pair(args=SMALL_VOCAB, cache: int = 128):
    target = ds.build(args, dtype=torch.float64)
    target.setup_cache(1, cache)
    draft = e3.build_draft(e3.DraftArgs.for_target(args), dtype=torch.float64, seed=1)
    return target, draft


class HintedDraft(e3.Eagle3Draft):
    """The draft network plus a strong hint: the token that followed the input token in the
    target's greedy output. Often right, sometimes wrong: long paths get accepted and rejected."""

    def __init__(self, args: e3.DraftArgs, hint: torch.Tensor):
        super().__init__(args)
        self.register_buffer("hint", hint)

    def forward(self, tokens, *rest):
        logits, hidden = super().forward(tokens, *rest)
        return logits + 20 * F.one_hot(self.hint[tokens], logits.shape[-1]), hidden


def hinted_draft(draft: e3.Eagle3Draft, sequence: torch.Tensor) -> HintedDraft:
    hint = torch.zeros(draft.args.target_vocab, dtype=torch.long)
    hint[sequence[:-1]] = sequence[1:]
    hinted = HintedDraft(draft.args, hint)
    hinted.load_state_dict(draft.state_dict(), strict=False)
    return hinted.double()


@torch.no_grad()
def test_draft_tree_shape_and_determinism():
    target, draft = make_pair()
    logits, hidden = e3.prefill(target, PROMPT)
    draft.setup_cache(128)
    tokens = torch.cat([PROMPT[1:], logits[-1:].argmax(-1)])
    trees = [e3.draft_tree(draft, tokens, hidden, len(PROMPT), top_k=4, depth=4, total_tokens=20)
             for _ in range(2)]
    tree = trees[0]
    assert all(torch.equal(a, b) for a, b in zip(vars(trees[0]).values(), vars(trees[1]).values()))
    assert tree.tokens.shape == (20,) and tree.tokens[0] == tokens[-1]
    assert int(tree.depth.max()) <= 4
    for kids in tree.children():  # siblings are distinct candidates
        assert len(set(tree.tokens[kids].tolist())) == len(kids)
    with pytest.raises(ValueError, match="total_tokens"):
        e3.draft_tree(draft, tokens, hidden, len(PROMPT), top_k=2, depth=2, total_tokens=8)


# ---- speculative decoding == greedy ---------------------------------------------------


def logging_verify(verify_fn, log: list):
    """``verify_fn``, logging each call's (tokens [N], input_pos [N], tree mask [N, N])."""

    def verify(model, tokens, input_pos, cache_pos, mask):
        log.append((tokens[0], input_pos, mask[0, 0][:, cache_pos]))
        return verify_fn(model, tokens, input_pos, cache_pos, mask)

    return verify


def accepted_lengths(log: list, seq: torch.Tensor) -> list[int]:
    """What greedy acceptance must emit at each logged verify, from the target's own greedy
    sequence ``seq`` (prompt + output, long enough to cover every tree): 1 + the depth of the
    deepest node that, like every ancestor, holds the token of ``seq`` at its position."""
    lengths = []
    for tokens, pos, sees in log:
        right = tokens == seq[pos]  # [N]
        on_right_path = (right[None, :] | ~sees).all(1)  # itself and every ancestor right
        lengths.append(1 + int((pos - pos[0])[on_right_path].max()))
    return lengths


def test_speculative_greedy_equals_greedy_compiled_verify():
    """Fails also if acceptance stops short of, or runs past, the longest right path (e.g.
    accept_greedy taking the first path, or dropping the path's last node)."""
    torch._dynamo.reset()
    graphs = []  # the verify step goes through the fxcoalesce pipeline (Python codegen)
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager", strict=True),
                            on_graph=lambda before, after, report: graphs.append(report))
    verify, log = torch.compile(e3.verify_step, backend=be, fullgraph=True), []
    target, draft = make_pair()
    seq = torch.cat([PROMPT, e3.greedy_generate(target, PROMPT, 48)])
    draft = hinted_draft(draft, seq)
    got, stats = e3.speculative_generate(target, draft, PROMPT, 40,
                                         verify_fn=logging_verify(verify, log),
                                         top_k=4, depth=4, total_tokens=16)
    torch._dynamo.reset()
    assert torch.equal(got, seq[len(PROMPT) : len(PROMPT) + 40])
    assert len(graphs) == 1  # fixed tree size: one compile for every step
    assert stats.accepted == accepted_lengths(log, seq)
    assert max(stats.accepted) >= 4 and min(stats.accepted) < 4, stats.accepted  # both happen


@pytest.mark.parametrize("top_k, depth, total_tokens", [(8, 5, 30), (2, 6, 12), (1, 3, 4)])
def test_speculative_greedy_equals_greedy(top_k, depth, total_tokens):
    """The target's own greedy tokens, and at each verify exactly the longest right path
    accepted (with a random draft: only the bonus token, every time)."""
    target, draft = make_pair(ds.CONFIGS["kimi-k2-tiny"])
    seq = torch.cat([PROMPT, e3.greedy_generate(target, PROMPT, 33 + depth + 1)])
    log = []
    got, stats = e3.speculative_generate(target, draft, PROMPT, 33, top_k=top_k, depth=depth,
                                         total_tokens=total_tokens,
                                         verify_fn=logging_verify(e3.verify_step, log))
    assert torch.equal(got, seq[len(PROMPT) : len(PROMPT) + 33])
    assert stats.accepted == accepted_lengths(log, seq)


class ScriptedDraft(e3.Eagle3Draft):
    """The draft network overruled by a script: at input position j (which holds the token
    at j + 1) the logit of ``script[j + 2]`` gets ``bias``."""

    def __init__(self, args: e3.DraftArgs, script: torch.Tensor, bias: float):
        super().__init__(args)
        self.register_buffer("script", script)
        self.bias = bias

    def forward(self, tokens, hidden, input_pos, cache_pos, mask):
        logits, hidden = super().forward(tokens, hidden, input_pos, cache_pos, mask)
        scripted = self.script[(input_pos + 2).clamp(max=self.script.shape[0] - 1)]  # [S]
        return logits + self.bias * F.one_hot(scripted, logits.shape[-1]), hidden


@pytest.mark.parametrize("bias, accepted", [(1e4, [5] * 7), (-1e4, [1] * 32)])
def test_accepted_length_follows_the_draft(bias, accepted):
    """A draft that knows the target's greedy tokens has its whole best path accepted, depth
    + 1 = 5 tokens per verify; one that ranks the target's token last has none accepted, 1 per
    verify. Fails if accept_greedy stops after one token, takes the first path instead of the
    longest or drops the path's last node; if draft_tree puts the prefix or the tree levels
    one position off (the script reads positions), reads the first level from the wrong
    logits row, or keeps nodes in pool order instead of by score; if the bonus token is
    counted twice."""
    target, draft = make_pair()
    seq = torch.cat([PROMPT, e3.greedy_generate(target, PROMPT, 40)])
    scripted = ScriptedDraft(draft.args, seq, bias)
    scripted.load_state_dict(draft.state_dict(), strict=False)
    got, stats = e3.speculative_generate(target, scripted.double(), PROMPT, 33, top_k=4,
                                         depth=4, total_tokens=16)
    assert torch.equal(got, seq[len(PROMPT) : len(PROMPT) + 33])
    assert stats.accepted == accepted


def test_speculative_sampling_runs_and_is_seeded():
    target, draft = make_pair()
    runs = [e3.speculative_generate(target, draft, PROMPT, 24, greedy=False, temperature=0.8,
                                    generator=torch.Generator().manual_seed(3), top_k=4, depth=3,
                                    total_tokens=12)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (24,)


def test_speculative_rejects_too_long_generation():
    target, draft = make_pair(cache=64)
    with pytest.raises(ValueError, match="exceed the target KV cache"):
        e3.speculative_generate(target, draft, PROMPT, 50, total_tokens=16, top_k=4, depth=4)


def _tp2_generate_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    target, draft = make_pair()
    tp1 = e3.greedy_generate(target, PROMPT, 40)
    seq = torch.cat([PROMPT, tp1])
    draft = hinted_draft(draft, seq)
    ds.apply_tp(target, dist.group.WORLD)
    tp2 = e3.greedy_generate(target, PROMPT, 32)
    reports, log = [], []
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager", strict=True),
                            on_graph=lambda before, after, report: reports.append(report))
    verify = torch.compile(e3.verify_step, backend=be, fullgraph=True)
    spec, stats = e3.speculative_generate(target, draft, PROMPT, 32,
                                          verify_fn=logging_verify(verify, log),
                                          top_k=4, depth=4, total_tokens=16)
    return dict(tp1=tp1[:32].tolist(), tp2=tp2.tolist(), spec=spec.tolist(),
                accepted=stats.accepted, right=accepted_lengths(log, seq),
                all_reduce=reports[0].all_reduce)


def test_speculative_greedy_tp2_gloo():
    ranks = spawn(_tp2_generate_worker, 2, backend="gloo")
    for r in ranks:
        assert r["tp2"] == r["tp1"] and r["spec"] == r["tp1"]
        assert r["accepted"] == r["right"]
        assert max(r["accepted"]) >= 3  # long paths were accepted, not only bonus tokens
        # shared + routed experts of each MoE layer fused: 1 + 4 + 1 + 3·2 = 12 -> 9
        assert r["all_reduce"]["before"] == 12 and r["all_reduce"]["after"] == 9
    assert ranks[0]["spec"] == ranks[1]["spec"]
    assert ranks[0]["accepted"] == ranks[1]["accepted"]
