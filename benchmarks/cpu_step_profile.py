"""Where a speculative step's time goes on this CPU: SmolLM2-135M (the cached GGUF) and the
committed head at TP 1, float32, uncompiled, the cache sized as the demo sizes it. Times the
greedy step, the (1,1,2) tree's step and its two halves (draft, verify), medians of 7, then
torch.profiler's top ops for greedy and spec (NOTES.md, session 9).

    python benchmarks/cpu_step_profile.py [threads]     # default 1
"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fxcoalesce.apps.bench.timing import timed
from fxcoalesce.apps.spec import smollm2
from fxcoalesce.apps.spec import treechoice as tc
from fxcoalesce.apps.spec.demo import head_path
from fxcoalesce.apps.spec.draft_head import load_head
from fxcoalesce.models import eagle3_static as es
from fxcoalesce.models.eagle3 import prefill


def median_ms(f, n: int = 7) -> float:
    f()
    return statistics.median(timed(f, "cpu")[1] for _ in range(n)) / 1e3


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    cpu = torch.device("cpu")
    target, tok = smollm2.load_target(device=cpu, dtype=torch.float32)
    draft, _ = load_head(head_path(None), target_name=smollm2.NAME, target_args=target.args,
                         embed_weight=target.embed.weight.detach().clone(), device=cpu,
                         dtype=torch.float32)
    room, draft_room = tc.room_for_candidates()
    ids = tok.encode_chat("Why is the sky blue?")
    T = -(-(len(ids) + 64 + room) // 64) * 64  # as the demo sizes its cache
    target.setup_cache(1, T)
    draft.setup_cache(T + draft_room)
    print("cache", T, "prompt", len(ids))
    logits, hidden = prefill(target, torch.tensor(ids))
    P, root = len(ids), logits[-1].argmax()
    greedy_state = torch.stack([root, torch.tensor(P)])
    spec = es.TreeSpec(top_k=1, depth=1, total_tokens=2)
    state = torch.zeros(spec.pairs + 2, dtype=torch.long)
    state[0], state[1], state[2] = P, 1, root
    pairs = hidden.new_zeros(spec.pairs, hidden.shape[-1])
    pairs[0] = hidden[-1]
    tree = es.draft_tree_static(draft, state[2:], pairs, state[1], state[0], spec)
    steps = {
        "greedy": lambda: es.decode_step(target, greedy_state),
        "spec": lambda: es.spec_step(target, draft, state, pairs, spec),
        "draft": lambda: es.draft_tree_static(draft, state[2:], pairs, state[1], state[0], spec),
        "verify": lambda: es.verify_accept_static(target, *tree[:4], state[0], spec.pairs),
    }
    for name, f in steps.items():
        print(f"{name} {median_ms(f):.1f} ms")
    for name in ("greedy", "spec"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                steps[name]()
        print(name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
