"""``fxcoalesce demo``: EAGLE-3 speculative decoding on a tensor-parallel Kimi-K2-shaped MoE
model, with the verify step compiled through fxcoalesce.

Every verify step runs twice on the same inputs, compiled without and with the pass, one
after the other: both write the same KV entries, their logits are compared, and each is
timed. Decoding continues from the pass's result. Each variant's first call compiles it
and is left out of the times. What the pass adds to its compile is measured inside it (the
report's ``pass_cost_ms``: pipeline and agreement); the compiles' totals follow the load
and the order they ran in one process, so they are not compared. Weights are random, so
the draft rarely matches the target and accepted lengths stay near 1 (``fxcoalesce demo``
without ``--model`` decodes SmolLM2-135M with its trained head). Progress goes to stderr
(rank 0; ``-q`` silences it).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fxcoalesce.compiler import backend
from fxcoalesce.config import Config
from fxcoalesce.apps.launch import default_backend, spawn
from fxcoalesce.apps.bench.records import percentile
from fxcoalesce.apps.bench.report import ranges_overlap
from fxcoalesce.apps.bench.timing import timed


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoOptions:
    model: str = "kimi-k2-tiny"
    """Target model name."""
    tokens: int = 32
    """New tokens to generate."""
    tree: int = 16
    """Tokens per verify step (tree size, root included)."""
    depth: int = 4
    """Draft tree depth."""
    top_k: int = 4
    """Children per expanded draft node."""
    prompt: int = 16
    """Prompt length (random token ids)."""
    codegen: str = "inductor"
    """Code generator for both verify variants."""
    hand_merged: bool = False
    """Use the engines' hand-merged model code as the target."""
    device: str = "cpu"
    """"cpu" or "cuda"."""
    progress: bool = True
    """Rank 0 says on stderr what it is compiling and how long that took."""


def demo_worker(rank: int, world: int, opt: DemoOptions) -> dict:
    from fxcoalesce import models
    from fxcoalesce.models import eagle3

    cuda = opt.device == "cuda"
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    torch.set_num_threads(max(1, (torch.get_num_threads()) // world) if not cuda else 1)
    group = dist.group.WORLD if world > 1 else None
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    note = ((lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 and opt.progress
            else (lambda *a: None))
    target = models.apply_tp(models.build(opt.model, hand_merged=opt.hand_merged, device=dev),
                             group)
    max_seq = opt.prompt + opt.tokens + 2 * opt.tree
    target.setup_cache(1, max_seq)
    draft = eagle3.build_draft(eagle3.DraftArgs.for_target(target.args), device=dev, seed=1)
    prompt = torch.randint(0, target.args.vocab, (opt.prompt,),
                           generator=torch.Generator().manual_seed(0)).to(dev)

    graphs = []
    keep = lambda before, after, report: graphs.append(report)  # noqa: E731
    variants = {
        "without pass": torch.compile(eagle3.verify_step, fullgraph=True, backend=backend(
            Config(passes=(), codegen=opt.codegen), on_graph=keep)),
        "with pass": torch.compile(eagle3.verify_step, fullgraph=True, backend=backend(
            Config(codegen=opt.codegen), on_graph=keep)),
    }
    what = {"without pass": "plain Inductor, Config(passes=())", "with pass": "fxcoalesce"}
    times = {k: [] for k in variants}
    compiled = set()
    same = []
    warm = []  # wall clock when the first (compiling) verify step returned

    def verify_both(*args):
        outs = {}
        for i, (k, fn) in enumerate(variants.items(), 1):
            if k not in compiled:  # the first call compiles: not timed, then run again
                note(f"  compiling the verify step {k} ({what[k]}, codegen {opt.codegen}) "
                     f"({i}/{len(variants)}) ...")
                start = time.perf_counter()
                fn(*args)
                compiled.add(k)
                note(f"    compiled in {time.perf_counter() - start:.1f} s (not counted in "
                     "the times below)")
            outs[k], us = timed(lambda: fn(*args), dev)
            times[k].append(us)
        a, b = outs.values()
        same.append(float((a[0].float() - b[0].float()).abs().max()))
        if len(same) == 1:
            warm.append(time.perf_counter())
        say(f"  verify {len(same):3d}: {times['without pass'][-1] / 1e3:7.2f} ms without, "
            f"{times['with pass'][-1] / 1e3:7.2f} ms with the pass")
        return outs["with pass"]

    say(f"speculative decoding: {opt.model}, TP={world}, {opt.tokens} new tokens, "
        f"tree of {opt.tree} tokens (depth {opt.depth}, top-k {opt.top_k})")
    out, stats = eagle3.speculative_generate(
        target, draft, prompt, opt.tokens, verify_fn=verify_both, top_k=opt.top_k,
        depth=opt.depth, total_tokens=opt.tree)
    # tokens/s after compilation, less the time spent in the unpassed comparison variant
    steady_s = time.perf_counter() - warm[0] - sum(times["without pass"][1:]) / 1e6
    steady_tokens = opt.tokens - 1 - stats.accepted[0]
    target.setup_cache(1, max_seq)
    reference = eagle3.greedy_generate(target, prompt, opt.tokens)
    with_report, without_report = graphs[-1], graphs[0]
    return {
        "rank": rank, "world_size": world, "backend": dist.get_backend() if group else "none",
        "all_reduce": with_report.all_reduce, "report_without": without_report.all_reduce,
        "verify_median_us": {k: statistics.median(v) for k, v in times.items()},
        "verify_p10_p90_us": {k: (percentile(v, 10), percentile(v, 90))
                              for k, v in times.items()},
        "pass_ms": with_report.pass_cost_ms(),
        "verify_calls": len(same), "logits_max_abs_diff": max(same),
        "matches_greedy": bool(torch.equal(out, reference)),
        "mean_accepted": stats.mean_accepted,
        "tokens_per_s": steady_tokens / max(steady_s, 1e-9),
        "tokens": out.tolist(),
    }


def run_demo(args) -> int:
    from fxcoalesce.apps.spec.smollm2 import NAME

    if args.model is None:  # the main job: merging, then EAGLE-3 on a real model
        from fxcoalesce.apps.tour import run_tour

        return run_tour(args)
    if args.model == NAME:  # pretrained weights and a trained draft head
        from fxcoalesce.apps.spec.demo import run_smollm2_demo

        return run_smollm2_demo(args)
    opt = DemoOptions(model=args.model, tokens=args.tokens or 32,
                      codegen=args.codegen or "inductor", hand_merged=args.hand_merged,
                      device=args.device, progress=not getattr(args, "quiet", False))
    t0 = time.perf_counter()
    if args.tp == 1:
        res = [demo_worker(0, 1, opt)]
    else:
        be = args.backend or default_backend(opt.device, args.tp)
        if opt.progress:
            print(f"starting {args.tp} {be} ranks ...", file=sys.stderr, flush=True)
        res = spawn(demo_worker, args.tp, (opt,), backend=be)
    print(summary(res, opt, args.tp))
    print(f"  wall time                      : {time.perf_counter() - t0:.0f} s")
    if getattr(args, "out", None):
        print(f"wrote {write_demo_json(res, opt, args)}")
    return 0


def summary(res: list[dict], opt: DemoOptions, tp: int) -> str:
    """What the demo found, from every rank's result (rank 0's times)."""
    from fxcoalesce.apps.spec.demo import pass_cost_text

    r = res[0]
    a = r["all_reduce"]
    diff = max(x["logits_max_abs_diff"] for x in res)
    noise = "; the ranges overlap: within noise" if _within_noise(r) else ""
    return "\n".join([
        f"\n{opt.model}{' (hand-merged)' if opt.hand_merged else ''}, TP={tp} "
        f"({r['backend']}), verify step of {opt.tree} tokens, codegen {opt.codegen}",
        f"  all_reduce launches per verify : {a['before']} -> {a['after']} "
        f"(lower bound {a['lower_bound']})",
        f"  verify latency median (p10-p90): {_spread(r, 'without pass')} without the pass, "
        f"{_spread(r, 'with pass')} with it ({r['verify_calls']} calls each{noise})",
        f"  logits with vs without, max |Δ| : {diff:.3g}"
        + (" (identical)" if diff == 0 else " (the linearity pass adds partial sums before "
           "reducing; Config(reassociate=False) is bit-exact)"),
        f"  tokens equal target greedy     : {all(x['matches_greedy'] for x in res)}",
        f"  ranks agree                    : {all(x['tokens'] == r['tokens'] for x in res)}",
        f"  mean accepted length           : {r['mean_accepted']:.2f} tokens per verify "
        "(random weights: the draft rarely agrees with the target; `fxcoalesce demo "
        "--model smollm2-135m` runs a pretrained target with a trained head)",
        f"  tokens per second              : {r['tokens_per_s']:.1f} (with the pass, after "
        "compilation; draft and acceptance included)",
        f"  fxcoalesce inside the compile  : {pass_cost_text(r['pass_ms'])} (a compile's "
        "total follows the load and the order of compiles: not compared)",
    ])


def _spread(r: dict, k: str) -> str:
    """'19.67 ms (12.10-30.20)': a variant's median verify time and its p10-p90 range."""
    lo, hi = r["verify_p10_p90_us"][k]
    return f"{r['verify_median_us'][k] / 1e3:.2f} ms ({lo / 1e3:.2f}-{hi / 1e3:.2f})"


def _within_noise(r: dict) -> bool:
    ranges = [r["verify_p10_p90_us"][k] for k in ("without pass", "with pass")]
    return ranges_overlap(*ranges)


def write_demo_json(res: list[dict], opt: DemoOptions, args) -> Path:
    """``DIR/demo.json``: the figures the demo prints (``text`` when the model has one)."""
    r = res[0]
    ms = {k: round(v / 1e3, 4) for k, v in r["verify_median_us"].items()}
    data = {
        "model": opt.model, "tp": args.tp, "hand_merged": opt.hand_merged,
        "backend": r["backend"], "device": opt.device, "codegen": opt.codegen,
        "new_tokens": opt.tokens, "tree_tokens": opt.tree,
        "all_reduce": {k: r["all_reduce"][k] for k in ("before", "after", "lower_bound")},
        "verify_ms": {"without": ms["without pass"], "with": ms["with pass"]},
        "verify_ms_p10_p90": {k.split()[0]: [round(x / 1e3, 4) for x in v]
                              for k, v in r["verify_p10_p90_us"].items()},
        "verify_within_noise": _within_noise(r),
        "verify_calls": r["verify_calls"],
        "pass_ms": r["pass_ms"],
        "logits_max_abs_diff": max(x["logits_max_abs_diff"] for x in res),
        "tokens_equal_target_greedy": all(x["matches_greedy"] for x in res),
        "mean_accepted": r["mean_accepted"], "tokens_per_s": round(r["tokens_per_s"], 2),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": getattr(args, "command_line", ""),
    }
    if r.get("text") is not None:
        data["text"] = r["text"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(data, indent=2) + "\n")
    return out / "demo.json"
