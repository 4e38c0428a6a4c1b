"""The ``fxcoalesce`` command: inspect, bench, demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fxcoalesce.config import Config


def _table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def cmd_inspect(args) -> int:
    from fxcoalesce import models
    from fxcoalesce.pipeline import graph_text
    from fxcoalesce.apps.trace import trace_model

    if args.list:
        for name in models.model_names():
            print(name)
        return 0
    if not args.model:
        raise SystemExit("fxcoalesce inspect: --model is required (see --list)")
    cfg = Config(bucket_cap_mb=args.bucket_cap_mb)
    print(f"tracing {args.model} step={args.step} tp={args.tp} tokens={args.tokens} "
          "under fake tensors ...", file=sys.stderr)
    t = trace_model(args.model, tp=args.tp, tokens=args.tokens, step=args.step,
                    hand_merged=args.hand_merged, config=cfg, layers=args.layers)
    r = t.report
    a = r.all_reduce
    rewrite_ms = r.analysis_ms + sum(p["ms"] for p in r.passes)
    print(f"{args.model}{' (hand-merged)' if args.hand_merged else ''}  step={args.step}  "
          f"TP={args.tp}  tokens={args.tokens}")
    print(_table([
        ("all_reduce launches", f"{a['before']} -> {a['after']}  (lower bound {a['lower_bound']})"),
        ("all_reduce bytes", f"{a['bytes_before']} -> {a['bytes_after']}"),
        ("predicted comm (µs)", f"{r.predicted_comm_us['before']} -> "
                                f"{r.predicted_comm_us['after']}"),
        ("buckets", len(r.buckets)),
        ("other collectives", r.other_collectives or "none"),
        ("graph nodes", f"{r.nodes['before']} -> {r.nodes['after']}"),
        ("analysis + passes", f"{rewrite_ms:.1f} ms  "
                              + ", ".join(f"{p['name']} {p['ms']:.1f} ms" for p in r.passes)),
        ("trace time", f"{t.seconds:.1f} s"),
        ("verdict", r.verdict),
    ]))
    for w in r.warnings:
        print(f"  warning: {w}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        extra = {"model": args.model, "world_size": args.tp, "tokens": args.tokens,
                 "step": args.step, "hand_merged": args.hand_merged, "layers": args.layers,
                 "trace_s": round(t.seconds, 2), "rewrite_ms": round(rewrite_ms, 2)}
        (out / "report.json").write_text(r.to_json(**extra))
        (out / "before.txt").write_text(graph_text(t.before))
        (out / "after.txt").write_text(graph_text(t.after))
        print(f"wrote {out}/report.json, before.txt, after.txt")
    return 0


def cmd_bench(args) -> int:
    from fxcoalesce.apps.bench import bench_worker
    from fxcoalesce.apps.launch import spawn

    print(f"bench {args.model} TP={args.tp} tokens={args.tokens}: {args.warmup} warm-up + "
          f"{args.steps} timed steps per variant, compiling ...", file=sys.stderr)
    res = spawn(bench_worker, args.tp, (args.model, args.tokens, args.steps, args.warmup,
                                        args.codegen, args.hand_merged, args.device),
                backend=args.backend)
    r0 = res[0]
    print(f"{args.model} TP={args.tp} ({r0['backend']}, {r0['device']}, codegen "
          f"{args.codegen}), tokens={args.tokens}")
    a = r0["all_reduce"]
    print(_table([(f"{k} median", f"{v:.0f} µs  (p10 {r0['p10_us'][k]:.0f}, "
                                  f"p90 {r0['p90_us'][k]:.0f})")
                  for k, v in r0["median_us"].items()] + [
        ("all_reduce launches", f"{a['before']} -> {a['after']} (bound {a['lower_bound']})"),
        ("outputs identical", all(r["identical"] for r in res)),
        ("max |diff|", max(r["max_abs_diff"] for r in res)),
    ]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return 0


def cmd_demo(args) -> int:
    from fxcoalesce.apps.demo import run_demo

    return run_demo(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxcoalesce", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log each graph's report")
    sub = p.add_subparsers(dest="cmd", required=True)

    i = sub.add_parser("inspect", help="trace a named model under fake tensors and show "
                                       "what the pipeline does")
    i.add_argument("--model", help="model name (see --list)")
    i.add_argument("--list", action="store_true", help="list the model names")
    i.add_argument("--tp", type=int, default=8, help="tensor-parallel world size")
    i.add_argument("--tokens", type=int, default=3, help="tokens in the traced step")
    i.add_argument("--step", default="forward", choices=["forward", "verify"])
    i.add_argument("--hand-merged", action="store_true",
                   help="the engines' hand-merged model code (baseline)")
    i.add_argument("--layers", type=int, help="override the model's layer count")
    i.add_argument("--bucket-cap-mb", type=float, default=Config().bucket_cap_mb)
    i.add_argument("--out", help="directory for report.json, before.txt, after.txt")
    i.set_defaults(fn=cmd_inspect)

    b = sub.add_parser("bench", help="step latency with and without the pass on real ranks")
    b.add_argument("--model", default="neox-tiny")
    b.add_argument("--tp", type=int, default=2)
    b.add_argument("--tokens", type=int, default=8)
    b.add_argument("--steps", type=int, default=50)
    b.add_argument("--warmup", type=int, default=5)
    b.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    b.add_argument("--hand-merged", action="store_true")
    b.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with >= 2 GPUs")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--out", help="write all ranks' results as JSON here")
    b.set_defaults(fn=cmd_bench)

    d = sub.add_parser("demo", help="EAGLE-3 speculative decoding with the verify step "
                                    "compiled through fxcoalesce")
    d.add_argument("--model", default="kimi-k2-tiny")
    d.add_argument("--tp", type=int, default=2, help="ranks (gloo processes on CPU)")
    d.add_argument("--tokens", type=int, default=32, help="new tokens to generate")
    d.add_argument("--backend", choices=["gloo", "nccl"],
                   help="default: gloo on CPU, nccl with --device cuda and >= 2 GPUs")
    d.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    d.add_argument("--hand-merged", action="store_true")
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return args.fn(args)
    except ValueError as e:  # bad input from the user: a message, not a stack trace
        print(f"fxcoalesce {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
