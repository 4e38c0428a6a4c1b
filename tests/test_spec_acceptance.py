"""benchmarks/spec_acceptance.py's bookkeeping of training's hits (issue 34 item 2): where a
chain through each position starts, and the decoder's walk (each chain continues the bonus
token after the accepted ones). Checked against a brute force over chain starts."""

import importlib.util
import random
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location(
    "spec_acceptance", Path(__file__).parent.parent / "benchmarks" / "spec_acceptance.py")
acc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(acc)


def test_the_walk_continues_after_the_bonus_token_and_reads_step_k_k_positions_on():
    S, prompt_len = 10, 3
    hit = [torch.ones(S, dtype=torch.bool), torch.arange(S) % 2 == 1]
    # starts 2 (steps at 2, 3: both hit), 5 (6 misses), 7 (8 misses), 9 (10 is past the text)
    assert acc.walk(hit, prompt_len) == [2, 1, 1, 1]
    assert acc.walk([torch.zeros(S, dtype=torch.bool)] * 2, prompt_len) == [0] * 8  # starts 2..9
    # the decoder's per-depth rates from tokens per step (accepted + 1)
    assert acc.per_depth([[3, 2, 2, 2]], 2) == ([1.0, 0.25], [4, 4])


def test_chain_counts_equal_a_brute_force_over_chain_starts():
    rng = random.Random(0)
    for _ in range(20):
        S, steps, prompt_len = rng.randint(3, 30), rng.randint(1, 4), rng.randint(0, 8)
        hit = [torch.tensor([rng.random() < 0.6 for _ in range(S)]) for _ in range(steps)]
        first = max(prompt_len - 2, 0)
        for k, (h, n, ch, reached) in enumerate(acc.hit_counts(hit, prompt_len)):
            scored = [p for p in range(S) if p >= k and p >= first]
            assert (h, n) == (sum(bool(hit[k][p]) for p in scored), len(scored))
            starts = [o for o in range(first, S - k)
                      if all(hit[j][o + j] for j in range(k))]
            assert reached == len(starts)
            assert ch == sum(bool(hit[k][o + k]) for o in starts)
