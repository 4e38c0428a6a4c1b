"""When would the speculative decoding's guard give a tree up? The decoder's accepted tokens
per step on held-out prompts (SmolLM2-135M, the committed head, float32 on this CPU), then
``specdecode.step_rate_guard`` replayed over them with a clock that ticks a GPU's step times
(default: an H100's confirmed (8, 6, 64) step, 3.0 ms, against greedy's 1.8 ms).

    python3 benchmarks/guard_replay.py --prompts 32 --tokens 96 --out DIR/accepted.json
    python3 benchmarks/guard_replay.py --accepted DIR/accepted.json --first 4

Prints the mean accepted length by step index and the prompts the guard gives up on (and at
which step); a prompt whose own mean is well above the break-even is given up falsely.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def decode(prompts: int, tokens: int, tree: tuple[int, int, int]) -> list[list[int]]:
    from fxcoalesce.apps.spec import smollm2
    from fxcoalesce.apps.spec.draft_head import load_head
    from fxcoalesce.apps.spec.prompts import held_out_prompts
    from fxcoalesce.models import eagle3_static as es

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    target, tok = smollm2.load_target(device=dev, dtype=torch.float32, path=smollm2.gguf_path())
    draft, _ = load_head(str(Path(__file__).parents[1] / "heads/smollm2-135m"),
                         target_name=smollm2.NAME, target_args=target.args,
                         embed_weight=target.embed.weight.detach().clone(), device=dev,
                         dtype=torch.float32)
    spec = es.TreeSpec(top_k=tree[0], depth=tree[1], total_tokens=tree[2])
    rows = []
    for i, text in enumerate(held_out_prompts(prompts)):
        ids = tok.encode_chat(text)
        T = -(-(len(ids) + tokens + spec.total_tokens) // 64) * 64
        target.setup_cache(1, T)
        draft.setup_cache(T + spec.draft_slots())
        _, stats = es.speculative_generate_static(target, draft, torch.tensor(ids), tokens,
                                                  spec=spec, stop_tokens=(tok.eos_id,))
        rows.append(stats.accepted)
        print(f"prompt {i}: {stats.accepted}", file=sys.stderr, flush=True)
    return rows


def gives_up(accepted: list[int], step_s: float, greedy_s: float, first: int) -> int | None:
    """The step at which ``step_rate_guard`` (its check from step ``first``) gives up."""
    from fxcoalesce.apps.spec import specdecode as sd

    now = [0.0]
    guard = sd.step_rate_guard(1 / greedy_s, None, torch.device("cpu"), first=first,
                               clock=lambda: now[0])
    tokens = 1
    for step, a in enumerate(accepted, 1):
        now[0] += step_s
        tokens += a
        if guard(step, tokens):
            return step
    return None


def main(argv=None) -> int:
    from fxcoalesce.apps.spec import specdecode as sd

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accepted", help="a JSON of accepted tokens per step (skips decoding)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--tree", default="8,6,64")
    p.add_argument("--step-ms", type=float, default=3.0, help="the tree's step")
    p.add_argument("--greedy-ms", type=float, default=1.8, help="greedy's step")
    p.add_argument("--first", type=int, nargs="*", default=None,
                   help=f"the guard's first check(s) to replay (default 4 and GUARD_FIRST, "
                        f"{sd.GUARD_FIRST})")
    p.add_argument("--out", help="write the accepted tokens per step here")
    args = p.parse_args(argv)
    if args.accepted:
        rows = json.loads(Path(args.accepted).read_text())
    else:
        rows = decode(args.prompts, args.tokens, tuple(map(int, args.tree.split(","))))
    if args.out:
        Path(args.out).write_text(json.dumps(rows))
    by_step = [round(statistics.mean(r[i] for r in rows if len(r) > i), 2) for i in range(8)]
    print(f"{len(rows)} prompts; mean accepted by step 1..8: {by_step}; per prompt "
          f"{min(map(statistics.mean, rows)):.2f}-{max(map(statistics.mean, rows)):.2f}")
    need = args.step_ms / args.greedy_ms * sd.GUARD_RATIO
    print(f"break-even: {need:.2f} tokens a step ({args.step_ms} against {args.greedy_ms} ms, "
          f"x{sd.GUARD_RATIO})")
    for first in args.first or sorted({4, sd.GUARD_FIRST}):
        gave = [(i, s, round(statistics.mean(r), 2)) for i, r in enumerate(rows)
                if (s := gives_up(r, args.step_ms / 1e3, args.greedy_ms / 1e3, first))]
        print(f"first check at step {first}: gives up on {len(gave)} of {len(rows)} "
              f"(prompt, step, its mean accepted): {gave}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
