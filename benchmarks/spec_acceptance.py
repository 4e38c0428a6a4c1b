"""The head's acceptance two ways on the same text (issue 34 item 2): teacher-forced, as
train-draft measures it (``eagle3_train.unrolled_forward``, step k's top-1 against the
target's argmax), and in the decoder (``eagle3_static.spec_step``, chains of 1..4 draft
tokens: top_k 1, total_tokens depth + 1), per depth.

    python3 benchmarks/spec_acceptance.py --prompts 3 --tokens 64 --out DIR/acceptance.json
    python3 benchmarks/spec_acceptance.py --tp 2 ...          # 2 gloo ranks, target sharded
    python3 benchmarks/spec_acceptance.py --write-head --prompts 8 --tokens 96

``--write-head`` instead keeps, beside the head's config, the accepted length of each of
``treechoice.CANDIDATES`` (``acceptance.json``, per dtype), walked along the greedy answers
to held-out prompts (``treechoice.simulate``, which takes the decoder's steps): what the
tree chooser reads.

Prompts: ``--set held-out`` (the demo's kind: templates and topics training never saw),
``--set train`` (training's own prompts, whose responses the head was trained on) or
``--set unseen`` (training's templates and topics, prompts the head never answered: those past
its ``prompts_used`` in training's order, the text a training batch scores before it has
trained on it). The text
scored teacher-forced is the target's greedy answer, which every chain reproduces.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def teacher_forced(target, draft, ids: list[int], prompt_len: int, steps: int):
    """[step] [n - 2] bool: step k's draft argmax (mapped to target ids) against the target's
    argmax at each position p (token x_{p+1}, state h_p, predicting x_{p+2}) of training's own
    forward (``unrolled_forward``); the target's argmax over its whole vocabulary (the
    decoder's test), not only the draft vocabulary's."""
    from fxcoalesce.models.eagle3 import prefill
    from fxcoalesce.models.eagle3_train import unrolled_forward

    seq = torch.tensor(ids)
    target.setup_cache(1, -(-len(ids) // 64) * 64)
    logits, hidden = prefill(target, seq)  # [n, V], [n, 3H]
    want = logits.argmax(-1)  # target's next token after each position
    S = len(ids) - 2  # positions p = 0 .. n - 3: token x_{p+1}, state h_p, label at p + 1
    outs = unrolled_forward(draft, seq[None, 1 : S + 1], hidden[None, :S], steps)
    return [draft.to_target(lg[0].argmax(-1)) == want[1 : S + 1] for lg in outs]


def hit_counts(hit: list[torch.Tensor], prompt_len: int) -> list[list[int]]:
    """[step][hits, positions, chain hits, chains reached]. The first two as ``ttt_loss``
    counts them: positions p >= k whose label x_{p+2} is a response token. The last two count
    the hits as a chain meets them: step k at position p continues the chain that starts at
    p - k (step j of it at p - k + j); "reached" where that chain starts in the response and
    its steps 0..k-1 all hit, "chain hits" where step k hits too. Their ratio is P(depth k + 1
    accepted | depth k accepted) over every start, the decoder's per-depth rate if a chain
    started everywhere."""
    S = len(hit[0])
    p = torch.arange(S)
    start = max(prompt_len - 2, 0)
    res = []
    for k in range(len(hit)):
        ok = (p >= k) & (p >= start)
        reached = p >= k + start
        for j in range(k):  # step j of the chain through p sits k - j positions back
            back = k - j
            reached &= torch.cat([torch.zeros(back, dtype=torch.bool), hit[j][: S - back]])
        res.append([int((hit[k] & ok).sum()), int(ok.sum()),
                    int((hit[k] & reached).sum()), int(reached.sum())])
    return res


def walk(hit: list[torch.Tensor], prompt_len: int) -> list[int]:
    """Draft tokens accepted per step by a chain of ``len(hit)`` walked along the text as the
    decoder walks it, with training's hits: the first chain continues the target's first
    response token (position prompt_len - 1), each next one the bonus token after the
    accepted ones (position + accepted + 1)."""
    out, o, S = [], prompt_len - 1, len(hit[0])
    while o < S:
        a = 0
        while a < len(hit) and o + a < S and bool(hit[a][o + a]):
            a += 1
        out.append(a)
        o += a + 1
    return out


def chain_run(target, draft, prompt: list[int], tokens: int, depth: int, eos: int):
    """Greedy EAGLE-3 with a chain of ``depth`` draft tokens (uncompiled): (tokens, accepted
    per step)."""
    from fxcoalesce.models import eagle3_static as es

    spec = es.TreeSpec(top_k=1, depth=depth, total_tokens=depth + 1)
    T = -(-(len(prompt) + tokens + spec.total_tokens) // 64) * 64
    target.setup_cache(1, T)
    draft.setup_cache(T + spec.draft_slots())
    out, stats = es.speculative_generate_static(target, draft, torch.tensor(prompt), tokens,
                                                spec=spec, stop_tokens=(eos,))
    return out, stats.accepted


def per_depth(accepted: list[list[int]], depth: int) -> tuple[list[float], list[int]]:
    """P(draft token d accepted | d - 1 accepted), d = 1..depth, from tokens emitted per step
    (accepted + 1); and how many steps reached depth d - 1 (each rate's sample)."""
    flat = [a - 1 for run in accepted for a in run]
    rates, tried = [], []
    for d in range(1, depth + 1):
        reached = sum(a >= d - 1 for a in flat)
        rates.append(round(sum(a >= d for a in flat) / max(reached, 1), 4))
        tried.append(reached)
    return rates, tried


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=None, help="head directory (default: the repository's)")
    p.add_argument("--set", default="held-out", choices=["held-out", "train", "unseen"])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--depths", default="1,2,3,4")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--tp", type=int, default=1, help="gloo ranks (the target sharded)")
    p.add_argument("--write-head", action="store_true",
                   help="write the head's acceptance.json (treechoice.CANDIDATES) instead")
    return p


def worker(rank: int, world: int, argv: list[str]) -> dict:
    import torch.distributed as dist

    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)

    from fxcoalesce.apps.spec import smollm2
    from fxcoalesce.apps.spec.draft_head import head_path
    from fxcoalesce.apps.spec.draft_head import load_head
    from fxcoalesce.apps.spec.prompts import held_out_prompts, training_prompts

    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    target, tok = smollm2.load_target(dtype=dtype)
    head = head_path(args.draft)
    draft, meta = load_head(head, target_name=smollm2.NAME, target_args=target.args,
                            embed_weight=target.embed.weight.detach().clone(), dtype=dtype)
    if world > 1:
        from fxcoalesce.models import llama

        llama.apply_tp(target, dist.group.WORLD)
    used = meta.get("training", {}).get("prompts_used", 0) if args.set == "unseen" else 0
    texts = (held_out_prompts(args.prompts) if args.set == "held-out"
             else training_prompts(0)[used : used + args.prompts])
    depths = [int(d) for d in args.depths.split(",")]
    steps = max(depths)
    chains = {d: [] for d in depths}
    tf = [[0, 0, 0, 0] for _ in range(steps)]
    walked = []  # training's hits walked as the decoder walks (tokens per step)
    same = True
    with torch.no_grad():
        for text in texts:
            prompt = tok.encode_chat(text)
            answers = []
            for d in depths:
                out, acc = chain_run(target, draft, prompt, args.tokens, d, tok.eos_id)
                chains[d].append(acc)
                answers.append(out)
            same &= all(a == answers[0] for a in answers)
            hit = teacher_forced(target, draft, prompt + answers[0], len(prompt), steps)
            tf = [[a + b for a, b in zip(mine, theirs)]
                  for mine, theirs in zip(tf, hit_counts(hit, len(prompt)))]
            walked.append([a + 1 for a in walk(hit, len(prompt))])
            if rank == 0:
                print(f"  {text[:60]!r}: {len(answers[0])} tokens", file=sys.stderr, flush=True)
    record = {
        "head": str(head), "set": args.set, "prompts": len(texts), "tokens": args.tokens,
        "dtype": args.dtype, "torch": torch.__version__, "tp": world,
        "backend": "gloo" if world > 1 else "none",
        "training_top1": meta.get("training", {}).get("last_top1"),
        "teacher_forced_top1": [round(h / max(n, 1), 4) for h, n, _, _ in tf],
        "teacher_forced_positions": [n for _, n, _, _ in tf],
        "teacher_forced_chain_per_depth": [round(h / max(n, 1), 4) for _, _, h, n in tf],
        "teacher_forced_chains_reached": [n for _, _, _, n in tf],
        "teacher_forced_walk_per_depth": per_depth(walked, steps)[0],
        "chain": {d: {"accepted_length": round(sum(map(sum, chains[d]))
                                               / max(sum(map(len, chains[d])), 1), 3),
                      **dict(zip(("accept_per_depth", "tried_per_depth"),
                                 per_depth(chains[d], d)))} for d in depths},
        "chains_equal": same, "wall_s": round(time.perf_counter() - t0, 1),
    }
    return record


def write_head_stats(target, draft, tok, head: Path, args, dtype) -> dict:
    from fxcoalesce.apps.spec import treechoice as tc
    from fxcoalesce.apps.spec.prompts import held_out_prompts

    t0 = time.perf_counter()
    prompts = [tok.encode_chat(t) for t in held_out_prompts(args.prompts)]
    texts = tc.greedy_texts(target, prompts, args.tokens, tok.eos_id)
    stats = tc.accepted_lengths(target, draft, [(s, len(p)) for s, p in zip(texts, prompts)],
                                tc.CANDIDATES)
    stats |= {"prompts": args.prompts, "tokens": args.tokens, "torch": torch.__version__,
              "wall_s": round(time.perf_counter() - t0, 1)}
    path = head / tc.STATS_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["about"] = ("tokens per step (accepted + 1) of greedy EAGLE-3 with each tree "
                     "(top_k,depth,total_tokens), walked along the target's greedy answers to "
                     "held-out prompts (fxcoalesce.apps.spec.treechoice.simulate); the tree "
                     "chooser reads it")
    data["command"] = "python3 benchmarks/spec_acceptance.py " + " ".join(args.argv)
    data[args.dtype] = stats
    path.write_text(json.dumps(data, indent=1) + "\n")
    return {"wrote": str(path), args.dtype: stats}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    if args.write_head:
        if args.tp != 1:
            raise SystemExit("--write-head measures at TP 1 (the head's acceptance)")
        record = _write_head_tp1(args)
    elif args.tp == 1:
        record = worker(0, 1, argv)
    else:
        from fxcoalesce.apps.launch import spawn

        record = spawn(worker, args.tp, (argv,), backend="gloo")[0]
    record["command"] = "python3 benchmarks/spec_acceptance.py " + " ".join(argv)
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


def _write_head_tp1(args) -> dict:
    from fxcoalesce.apps.spec import smollm2
    from fxcoalesce.apps.spec.draft_head import head_path
    from fxcoalesce.apps.spec.draft_head import load_head

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tok = smollm2.load_target(dtype=dtype)
    head = head_path(args.draft)
    draft, _ = load_head(head, target_name=smollm2.NAME, target_args=target.args,
                         embed_weight=target.embed.weight.detach().clone(), dtype=dtype)
    with torch.no_grad():
        return write_head_stats(target, draft, tok, head, args, dtype)


if __name__ == "__main__":
    sys.exit(main())
