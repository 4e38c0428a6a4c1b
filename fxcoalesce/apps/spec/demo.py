"""``fxcoalesce demo --model smollm2-135m``: a real answer to ``--prompt``, decoded with a
trained EAGLE-3 head, against the target's own greedy decoding compiled the same way.

Both steps go through the fxcoalesce backend (CUDA graphs on GPUs); at TP > 1 the ranks are
spawned processes (NCCL with a GPU each, else gloo). The parent fetches the weights and
checks the prompt and the head before any rank starts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fxcoalesce.apps.spec import smollm2
from fxcoalesce.apps.spec.draft_head import check_compatible, read_config
from fxcoalesce.apps.launch import default_backend, spawn
from fxcoalesce.apps.spec.specdecode import SpecOptions, spec_worker, summarize

DEFAULT_HEAD = Path(__file__).resolve().parents[3] / "heads" / smollm2.NAME
"""The head committed with the repository (found from an editable install)."""
DEFAULT_TOKENS = 256


def head_path(given: str | None) -> Path:
    """``--draft``, else the repository's head; ValueError naming what to do when neither."""
    path = Path(given) if given else DEFAULT_HEAD
    if not path.is_dir():
        kind = "a file, not a head directory" if path.exists() else "no such directory"
        raise ValueError(f"--draft {path}: {kind}" if given else
                         f"no draft head at {DEFAULT_HEAD}: pass --draft DIR (fxcoalesce "
                         f"train-draft --target {smollm2.NAME} --out DIR trains one)")
    return path


def run_smollm2_demo(args) -> int:
    from fxcoalesce.models import llama

    t0 = time.perf_counter()
    target_args = llama.CONFIGS[smollm2.NAME]
    draft = head_path(args.draft)
    check_compatible(read_config(draft), draft, smollm2.NAME, target_args)
    gguf = smollm2.gguf_path()
    tok = smollm2.ChatTokenizer(smollm2.read_gguf(gguf))
    ids = tok.encode_chat(args.prompt)
    tokens = args.tokens or DEFAULT_TOKENS
    cuda = args.device == "cuda"
    opt = SpecOptions(gguf=str(gguf), draft=str(draft), prompts=(tuple(ids),), tokens=tokens,
                      device=args.device, codegen=args.codegen or ("inductor" if cuda else "eager"),
                      mode="reduce-overhead" if cuda else None, warmup_tokens=16)
    need = len(ids) + tokens + opt.total_tokens
    if need > target_args.max_seq_len:
        raise ValueError(f"the prompt is {len(ids)} tokens (chat template included); with "
                         f"--tokens {tokens} and a tree of {opt.total_tokens} it needs {need} "
                         f"positions, past {smollm2.NAME}'s context of {target_args.max_seq_len}")
    print(f"speculative decoding: {smollm2.NAME}, TP={args.tp}, head {draft}, up to {tokens} "
          f"new tokens, tree of {opt.total_tokens} (depth {opt.depth}, top-k {opt.top_k}), "
          f"codegen {opt.codegen}{', CUDA graphs' if cuda else ''}; compiling both steps ...",
          file=sys.stderr, flush=True)
    if args.tp == 1:
        ranks = [spec_worker(0, 1, opt)]
    else:
        ranks = spawn(spec_worker, args.tp, (opt,),
                      backend=args.backend or default_backend(args.device, args.tp))
    s = summarize(ranks[0], ranks)
    r = ranks[0]["results"][0]
    stopped = r["tokens"][-1] == tok.eos_id
    print(f"\n{args.prompt}\n\n{tok.decode(r['tokens']).strip()}\n")
    a = s["all_reduce_per_call"].get("spec")
    print(f"{smollm2.NAME}, TP={args.tp} ({s['backend']}), {s['device']}")
    if a and args.tp > 1:
        print(f"  all_reduce per speculative step  : {a['before']} -> {a['after']} (lower bound "
              f"{a['lower_bound']}: sequential blocks, one chain)")
    print(f"  new tokens                       : {r['spec_tokens']}"
          f"{' (stopped at EOS)' if stopped else ''}")
    print(f"  mean accepted length             : {s['mean_accepted']:.2f} tokens per verify")
    print(f"  tokens per second                : {s['tokens_per_s']['speculative']:.1f} "
          f"speculative, {s['tokens_per_s']['target_greedy']:.1f} target-only greedy "
          f"({s['speedup_vs_target_greedy']:.2f}x; prefill included, after compilation)")
    print(f"  tokens equal target greedy       : {r['same_tokens']}")
    print(f"  ranks agree                      : {s['ranks_agree']}")
    print(f"  wall time                        : {time.perf_counter() - t0:.0f} s")
    if getattr(args, "out", None):
        text = tok.decode(r["tokens"]).strip()
        print(f"wrote {write_demo_json(s, r, args, opt, text, stopped)}")
    return 0


def write_demo_json(s: dict, r: dict, args, opt: SpecOptions, text: str, stopped: bool) -> Path:
    """``DIR/demo.json`` with what the demo prints. No ``verify_ms``: this demo sets
    speculative decoding against greedy decoding, not the verify step with and without the
    pass (a sequential model is at its bound: nothing to rewrite)."""
    import torch

    spec = s["all_reduce_per_call"].get("spec") or {}
    data = {
        "model": smollm2.NAME, "tp": args.tp, "backend": s["backend"], "device": s["device"],
        "codegen": opt.codegen, "mode": opt.mode, "prompt": args.prompt, "head": opt.draft,
        "tree": {"top_k": opt.top_k, "depth": opt.depth, "total_tokens": opt.total_tokens},
        "all_reduce": {k: spec.get(k, 0) for k in ("before", "after", "lower_bound")},
        "new_tokens": r["spec_tokens"], "stopped_at_eos": stopped,
        "mean_accepted": s["mean_accepted"], "tokens_per_s": s["tokens_per_s"],
        "speedup_vs_target_greedy": s["speedup_vs_target_greedy"],
        "tokens_equal_target_greedy": r["same_tokens"], "ranks_agree": s["ranks_agree"],
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": getattr(args, "command_line", ""), "text": text,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(data, indent=2) + "\n")
    return out / "demo.json"
