"""SmolLM2-135M + a trained EAGLE-3 head on held-out prompts: mean accepted length and
end-to-end tokens/s of speculative against target-only greedy decoding, both compiled through
the fxcoalesce backend with the same settings (``--mode reduce-overhead``: CUDA graphs).

    python3 benchmarks/spec_bench.py --draft HEAD --tp 1 --device cuda --out spec_tp1.json

The tree is sized as ``fxcoalesce demo`` sizes it (``--tree auto``: this machine's step
times, the head's acceptance; greedy where no tree is faster; apps/spec/treechoice.py), or
forced (``--tree 8,6,64``, ``--tree greedy``, ``--tree spec``).

The GGUF comes from ``FXCOALESCE_SMOLLM2_GGUF`` or the cache (fetched once). The JSON is
rewritten after every prompt, so a run cut short still leaves its numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fxcoalesce.apps.spec import smollm2
from fxcoalesce.apps.launch import default_backend, spawn
from fxcoalesce.apps.spec.prompts import held_out_prompts
from fxcoalesce.apps.spec.specdecode import SpecOptions, ahead, spec_worker, summarize


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="draft head directory (train-draft --out)")
    p.add_argument("--tp", type=int, default=1, help="ranks (NCCL with a GPU each, else gloo)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts (default 32)")
    p.add_argument("--tokens", type=int, default=256, help="most new tokens per prompt")
    p.add_argument("--tree", default="auto", metavar="auto|measure|spec|greedy|K,D,N",
                   help="the tree: sized from measurement (auto: cached per machine, model, "
                        "head and TP degree; measure: anew; spec: the fastest tree even where "
                        "greedy is faster), greedy, or top-k,depth,total-tokens")
    p.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--mode", default="reduce-overhead",
                   help="torch.compile mode of both steps ('default': no CUDA graphs)")
    p.add_argument("--prefill", default=None, choices=["eager", "compiled"],
                   help="both decodings' prefill: eager in the prompt's shape, or compiled "
                        "like the steps, the prompt padded to a multiple of 64 (default: "
                        "compiled on cuda, eager on cpu)")
    p.add_argument("--launch-ahead", default=None, choices=["on", "off"],
                   help="both decodings launch each step before reading the last (default: "
                        "on cuda; specdecode.LAUNCH_AHEAD)")
    p.add_argument("--warmup-tokens", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights and activations (default: bfloat16 on cuda, float32 on cpu); "
                        "float32 tells near-ties of bf16 from faults: speculative tokens equal "
                        "greedy's")
    p.add_argument("--out", required=True, help="JSON file (rewritten after every prompt)")
    args = p.parse_args(argv)
    from fxcoalesce.apps.spec.treechoice import parse_tree

    tree = parse_tree(args.tree)
    args.prefill = args.prefill or ("compiled" if args.device == "cuda" else "eager")

    t0 = time.perf_counter()
    gguf = smollm2.gguf_path()
    tok = smollm2.ChatTokenizer(smollm2.read_gguf(gguf))
    texts = held_out_prompts(args.prompts)
    opt = SpecOptions(gguf=str(gguf), draft=args.draft,
                      prompts=tuple(tuple(tok.encode_chat(t)) for t in texts),
                      tokens=args.tokens, device=args.device, tree=tree, codegen=args.codegen,
                      mode=None if args.mode == "default" else args.mode,
                      warmup_tokens=args.warmup_tokens, progress=args.out,
                      prefill_compiled=args.prefill == "compiled", dtype=args.dtype,
                      launch_ahead=None if args.launch_ahead is None else args.launch_ahead == "on")
    print(f"spec_bench: {len(texts)} held-out prompts, TP {args.tp} on {args.device}, tree "
          f"{args.tree}, {args.codegen} mode {args.mode}, prefill {args.prefill}, launch ahead "
          f"{'on' if ahead(opt) else 'off'}, {args.dtype or 'default dtype'}", flush=True)
    if args.tp == 1:
        ranks = [spec_worker(0, 1, opt)]
    else:
        ranks = spawn(spec_worker, args.tp, (opt,),
                      backend=default_backend(args.device, args.tp))
    record = summarize(ranks[0], ranks)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["samples"] = [{"prompt": t, "response": tok.decode(r["tokens"])}
                         for t, r in zip(texts[:3], ranks[0]["results"])]
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("device", "tp", "tree", "mean_accepted",
                                             "tokens_per_s",
                                             "speedup_vs_target_greedy", "prefill_s",
                                             "speedup_past_prefill", "same_tokens_as_greedy",
                                             "prompts", "graphs_compiled", "wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
