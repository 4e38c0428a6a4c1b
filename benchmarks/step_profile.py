"""Where a speculative step's time goes: SmolLM2-135M (the cached GGUF, or
$FXCOALESCE_SMOLLM2_GGUF) and a head at TP 1, the cache sized as the demo sizes it. Times the
greedy step, a tree's step and its two halves (draft, verify), medians of 7 (CPU: float32,
uncompiled) or 21 (CUDA: bfloat16, each step captured in a CUDA graph as ``treechoice``
times the candidates, CUDA events), then torch.profiler's top ops for greedy and spec
(NOTES.md, sessions 9-10).

    python benchmarks/step_profile.py [--threads 1] [--tree 1,1,2] [--device cuda] [--head DIR]
                                      [--compile] [--random-weights]

``--compile``: each of the four through ``torch.compile`` (Inductor, fullgraph; on CUDA the
compiled call captured in a CUDA graph), as the decoder runs its steps, four compiles.
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from fxcoalesce.apps.bench.timing import timed
from fxcoalesce.apps.spec import smollm2
from fxcoalesce.apps.spec import treechoice as tc
from fxcoalesce.apps.spec.treechoice import _replayable
from fxcoalesce.apps.spec.draft_head import head_path
from fxcoalesce.apps.spec.draft_head import load_head
from fxcoalesce.models import eagle3_static as es
from fxcoalesce.models.eagle3 import prefill


def median_ms(f, dev: torch.device) -> float:
    run = _replayable(f, dev, None)  # warmed up; on CUDA a graph's replay
    n = 21 if dev.type == "cuda" else 7
    return statistics.median(timed(run, dev)[1] for _ in range(n)) / 1e3


def common_args(ap: argparse.ArgumentParser) -> None:
    """The options step_profile.py and loop_profile.py share."""
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tree", default="1,1,2", help="top_k,depth,total_tokens")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--head", help="head directory (default: the committed one)")
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2-135M's shape, seeded weights, a 36-token prompt (the chat "
                         "prompt's length), no GGUF (kernel times: the work is the same)")


def load(args):
    """(target, draft, prompt ids, device, dtype) as ``args`` ask: bf16 on CUDA, else fp32."""
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.random_weights:
        from fxcoalesce.models import llama

        target, tok = llama.build(smollm2.NAME, dtype=dtype, device=dev).eval(), None
    else:
        target, tok = smollm2.load_target(device=dev, dtype=dtype)
    draft, _ = load_head(head_path(args.head), target_name=smollm2.NAME,
                         target_args=target.args,
                         embed_weight=target.embed.weight.detach().clone(), device=dev,
                         dtype=dtype)
    ids = tok.encode_chat("Why is the sky blue?") if tok else list(range(1, 37))
    return target, draft, ids, dev, dtype


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--compile", action="store_true", help="time and profile compiled steps")
    args = ap.parse_args()
    target, draft, ids, dev, dtype = load(args)
    room, draft_room, _ = tc.room_for_candidates(tuple(int(x) for x in args.tree.split(",")))
    T = -(-(len(ids) + 64 + room) // 64) * 64  # as the demo sizes its cache
    target.setup_cache(1, T)
    draft.setup_cache(T + draft_room)
    print("device", dev, dtype, "cache", T, "prompt", len(ids), "tree", args.tree,
          "compiled" if args.compile else "eager")
    logits, hidden = prefill(target, torch.tensor(ids, device=dev))
    P, root = len(ids), logits[-1].argmax()
    greedy_state = torch.stack([root, torch.tensor(P, device=dev)])
    k, d, n = (int(x) for x in args.tree.split(","))
    spec = es.TreeSpec(top_k=k, depth=d, total_tokens=n)
    state = torch.zeros(spec.pairs + 2, dtype=torch.long, device=dev)
    state[0], state[1], state[2] = P, 1, root
    pairs = hidden.new_zeros(spec.pairs, hidden.shape[-1])
    pairs[0] = hidden[-1]
    tree = es.draft_tree_static(draft, state[2:], pairs, state[1], state[0], spec)
    fn = {"greedy": es.decode_step, "spec": es.spec_step, "draft": es.draft_tree_static,
          "verify": es.verify_accept_static}
    if args.compile:
        fn = {name: torch.compile(f, fullgraph=True) for name, f in fn.items()}
    steps = {
        "greedy": lambda: fn["greedy"](target, greedy_state),
        "spec": lambda: fn["spec"](target, draft, state, pairs, spec),
        "draft": lambda: fn["draft"](draft, state[2:], pairs, state[1], state[0], spec),
        "verify": lambda: fn["verify"](target, *tree[:4], state[0], spec.pairs),
    }
    for name, f in steps.items():
        print(f"{name} ...", end=" ", flush=True)  # a compile takes minutes on a CPU
        print(f"{median_ms(f, dev):.3f} ms", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    for name in ("greedy", "spec"):
        with profile(activities=activities) as prof:
            for _ in range(3):
                steps[name]()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        print(name)
        print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=160))


if __name__ == "__main__":
    main()
