"""The ``fxcoalesce`` command: inspect, bench, demo, train-draft, calibrate, doctor."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fxcoalesce.apps import checks
from fxcoalesce.apps.bench.variants import DEFAULT_VARIANTS, VARIANTS
from fxcoalesce.apps.defaults import DEFAULT_PROMPT
from fxcoalesce.apps.demo import TOKENS
from fxcoalesce.config import Config, did_you_mean
from fxcoalesce.viz.picture import MAX_BOXES


def _progress(text: str) -> None:
    """A line of progress: on stderr, so that it stays out of what a command writes."""
    print(text, file=sys.stderr, flush=True)


def cmd_inspect(args) -> int:
    from fxcoalesce import models
    from fxcoalesce.apps.inspect.command import draw_trace, run_inspect

    if args.list:
        for name in models.model_names():
            print(name)
        return 0
    if args.trace:
        draw_trace(args)
    if not args.model and not args.hf:
        return 0
    return run_inspect(args, say=(lambda text: None) if args.quiet else _progress)


def cmd_bench(args) -> int:
    import signal
    import time

    from fxcoalesce.apps.bench.run import BenchOptions, run_bench
    from fxcoalesce.apps.bench.report import text_table, write_all
    from fxcoalesce.apps.bench.variants import parse_variants
    from fxcoalesce.apps.defaults import backend_of

    be = backend_of(args)
    opt = BenchOptions(model=args.model, step=args.step, tokens=tuple(args.tokens),
                       layers=args.layers, dim=args.dim, tp=args.tp, backend=be,
                       device=args.device,
                       cudagraphs=args.cudagraphs,
                       nccl_mode=(args.nccl_mode or "nvlink") if be == "nccl" else None,
                       variants=parse_variants(args.variants), steps=args.steps,
                       calls_per_sample=args.calls_per_sample or (
                           10 if args.device == "cuda" else 1),
                       warmup=args.warmup, command=args.command_line,
                       trace_dir=args.out if args.trace else None, progress=not args.quiet)
    if args.trace:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    # a `timeout` or Ctrl-C ends this process: spawn then stops the ranks, none left behind
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start = time.perf_counter()
    if opt.progress:
        _progress(f"bench {opt.model}: {opt.tp} {be} rank{'s' * (opt.tp > 1)} on "
                  f"{opt.device}, tokens {','.join(map(str, opt.tokens))}, variants "
                  f"{', '.join(opt.variants)}; each compile takes a while (minutes on CPU) ...")
    records = run_bench(opt)
    for rec in records:
        print(text_table(rec) + "\n")
    if args.out:
        for line in write_all(records, args.out):
            print(line)
    print(f"wall time {time.perf_counter() - start:.0f} s")
    failed = [f"{name} ({why})" for rec in records for name, why in rec["skipped"].items()
              if why.startswith("failed")]
    if failed:
        _error("bench", f"variant(s) failed: {'; '.join(sorted(set(failed)))}")
        return 1
    return 0


def cmd_calibrate(args) -> int:
    from fxcoalesce.apps.bench.calibrate import run_calibrate, write_profile

    if not args.quiet:
        _progress(f"calibrate: {args.tp} {args.backend or 'gloo'} ranks on {args.device}, "
                  f"all_reduce from 8 B to {args.max_bytes} B ...")
    data = run_calibrate(args)
    write_profile(data, args.out)
    print(f"alpha {data['alpha_us']:.1f} µs, beta {data['beta_us_per_byte'] * 1e6:.1f} µs/MB "
          f"(single line); {len(data['segments'])} segment(s); worst error 1 KB-16 MB "
          f"{data['max_abs_error_1KB_16MB']:.1%}; CUDA graphs: {data['cudagraphs']}")
    for row in data["points"]:
        print(f"  {row['bytes']:>10} B  measured {row['measured_us']:>10.1f} µs  predicted "
              f"{row['predicted_us']:>10.1f} µs  ({row['error']:+.1%})")
    if "implementations" in data:
        _print_impls(data)
    if ov := data.get("overlap"):
        print(f"overlap efficiency {ov['efficiency']:.2f} (the share of an all_reduce that "
              "compute issued before its wait hides):")
        for row in ov["points"]:
            print(f"  {row['bytes']:>10} B  all_reduce {row['comm_us']:>8.1f} µs  "
                  f"{row['matmuls']} matmul(s) {row['compute_us']:>8.1f} µs  both "
                  f"{row['both_us']:>8.1f} µs  efficiency {row['efficiency']:.2f}")
    print(f"wrote {args.out}")
    return 0


def _print_impls(data: dict) -> None:
    """calibrate's other implementations: symmetric memory, each curve, what was left out,
    and a table of every size measured (µs, the slowest rank's median)."""
    symm = data["symm_mem"]
    print(f"symmetric memory: {'usable' if symm['usable'] else 'not usable'} ({symm['why']}; "
          f"{symm.get('checked_by', '')})")
    impls = data["implementations"]
    for name, c in impls.items():
        check = c["check"]
        print(f"{name} ({c['dtype']}): {len(c['segments'])} segment(s), worst error 1 KB-16 MB "
              f"{c['max_abs_error_1KB_16MB']:.1%}, up to {c['max_bytes']} B; CUDA graphs: "
              f"{c['cudagraphs']}; correct at {check['sizes']} sizes (worst error / bound "
              f"{check['worst_error_over_bound']:.2f}, same on every rank: "
              f"{check['same_on_every_rank']})")
        for key in ("capture", "lower"):
            if key in c:
                print(f"  {c[key]}")
    for name, why in data.get("implementations_left_out", {}).items():
        print(f"{name}: left out ({why})")
    if not impls:
        return
    measured = {name: {p["bytes"]: p["measured_us"] for p in c["points"]}
                for name, c in impls.items()}
    nccl = {p["bytes"]: p["measured_us"] for p in data["points"]}
    print("  " + f"{'bytes':>10}  {'nccl':>9}" + "".join(f"  {n[:10]:>10}" for n in impls))
    for b in sorted(set(nccl).union(*measured.values())):
        cells = [f"{m[b]:>10.1f}" if b in m else f"{'-':>10}" for m in measured.values()]
        print(f"  {b:>10}  {nccl.get(b, float('nan')):>9.1f}  " + "  ".join(cells))


def _int_list(text: str) -> tuple[int, ...]:
    """'3,16,64' -> (3, 16, 64)."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r} (e.g. 3,16,64)") \
            from None


def cmd_train_draft(args) -> int:
    from fxcoalesce.apps.spec.train_draft import TrainOptions, run_train_draft

    opt = TrainOptions(out=args.out, target=args.target, device=args.device,
                       minutes=args.minutes, gen_share=args.gen_share, prompts=args.prompts,
                       gen_batch=args.gen_batch,
                       gen_tokens=args.gen_tokens, draft_vocab=args.draft_vocab,
                       ttt_steps=args.ttt_steps, batch_tokens=args.batch_tokens, lr=args.lr,
                       epochs=args.epochs, held_out=args.held_out)
    stats = run_train_draft(opt, command="fxcoalesce " + " ".join(sys.argv[1:]))
    log = Path(args.out) / "train_log.json"
    log.write_text(json.dumps(stats, indent=1))
    print(f"{args.target} draft head in {args.out}: {stats['steps']} steps, "
          f"{stats['epochs']:.2f} epochs over {stats['response_tokens']} response tokens; "
          f"last top-1 agreement per unrolled step {stats['last_top1']}"
          + (f", on held-out prompts {stats['held_out_top1']}" if "held_out_top1" in stats else "")
          + f"; wrote {log}")
    return 0


def cmd_demo(args) -> int:
    from fxcoalesce.apps.demo import run_demo

    return run_demo(args)


def cmd_doctor(args) -> int:
    from fxcoalesce.apps.doctor import run_doctor

    return run_doctor(args)


def version_text() -> str:
    """'fxcoalesce 0.1.0 (torch 2.13.0+cpu, Python 3.11.9)', from the installed packages'
    metadata (torch is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    python = ".".join(map(str, sys.version_info[:3]))
    torch = of("torch")
    return (f"fxcoalesce {of('fxcoalesce') or 'unknown (not installed: pip install -e .)'} "
            f"({f'torch {torch}, ' if torch else 'torch not installed, '}Python {python})")


class _Version(argparse.Action):
    """``--version``: the version line on stdout, exit status 0 (read when asked for)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print fxcoalesce's version (and torch's, Python's) and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fxcoalesce", description="Tools of the fxcoalesce torch.compile backend (fewer, "
        "smaller all_reduces for tensor-parallel inference): inspect, bench, demo, "
        "train-draft, calibrate, doctor. 'fxcoalesce COMMAND --help' describes each.")
    p.add_argument("-V", "--version", action=_Version)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log each graph's report; show a failed rank's traceback")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines on stderr (what inspect traces, what demo and "
                        "bench compile, and how long each took); results and errors stay")
    sub = p.add_subparsers(dest="cmd", required=True)

    i = sub.add_parser("inspect", help="trace a model under fake tensors (a named one, your "
                                       "own factory, or a Hugging Face architecture) and show "
                                       "what the pipeline does")
    i.add_argument("--model",
                   help="a model name (--list names them), or your own factory: "
                        "package.module:function or path/to/file.py:function, returning "
                        "(module, plan, input_shape): the unsharded nn.Module, a "
                        "parallelize_module plan (module path -> ColwiseParallel() / "
                        "RowwiseParallel() / ...) or None when the module shards itself (a "
                        "function(group) is given the fake process group), and the example "
                        "input's shape; called on the meta device, so no weights")
    i.add_argument("--hf", metavar="TYPE|config.json",
                   help="a Hugging Face architecture: a transformers model type (cohere, "
                        "deepseek_v3, gpt_neox, llama, qwen3_moe, ...: its config class's "
                        "defaults, i.e. full size) or a config.json (or its directory), sharded "
                        "by its own base_model_tp_plan as tp_plan='auto' shards it (needs "
                        "transformers)")
    i.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="--hf only: override a config field, e.g. --set hidden_size=4096 "
                        "(repeatable; VALUE is read as JSON, else as text)")
    i.add_argument("--profile", metavar="FILE",
                   help="your profile from fxcoalesce calibrate, measured at --tp ranks: the "
                        "rewrite is chosen with it and its prediction comes first (default: "
                        "$FXCOALESCE_PROFILE, else the uncalibrated ring model); the measured "
                        "profiles under benchmarks/results are always shown too")
    i.add_argument("--list", action="store_true", help="list the model names and exit")
    i.add_argument("--tp", type=int, default=8,
                   help="tensor-parallel world size, traced on a fake group (default: %(default)s)")
    i.add_argument("--tokens", type=int,
                   help="tokens in the traced step (default: 3; a factory's input shape says "
                        "its own)")
    i.add_argument("--step", default="forward", choices=["forward", "verify"],
                   help="forward: prefill; verify: EAGLE-3 tree verification, the zoo's "
                        "KV-cached models only (default: %(default)s)")
    i.add_argument("--hand-merged", action="store_true",
                   help="trace the engines' hand-merged model code instead (the baseline; "
                        "zoo models)")
    i.add_argument("--layers", type=int,
                   help="override the number of layers of a zoo model or --hf config "
                        "(default: its own)")
    i.add_argument("--all-layers", action="store_true",
                   help="--hf and factories: trace every layer (default: one layer of each "
                        "kind, the first and the last apart, and the whole step's report "
                        "composed from them: the same counts, bytes and bound in a fraction "
                        "of the time; zoo models always trace every layer)")
    i.add_argument("--bucket-cap-mb", type=float, default=Config().bucket_cap_mb,
                   help="largest fused all_reduce, in MB (default: %(default)s)")
    i.add_argument("--out", help="directory to write report.json, before.txt and after.txt "
                                 "into, created if missing (default: write nothing)")
    i.add_argument("--format", default="txt", choices=["txt", "dot", "svg", "png"],
                   help="txt: the table (and the files above); dot, svg, png: also a picture "
                        "of the collectives and their dependencies before and after, buckets "
                        "coloured, as --out/collectives.dot (and .svg/.png: Graphviz if "
                        "installed, else matplotlib); dot without --out prints the DOT on "
                        "stdout and the table on stderr (default: %(default)s)")
    i.add_argument("--collapse", default="auto", choices=["auto", "none", "layers", "levels"],
                   help="one box per layer or per range of dependency depths instead of one "
                        f"per collective; auto: per layer above {MAX_BOXES} collectives "
                        "(default: %(default)s)")
    i.add_argument("--timeline", action="store_true",
                   help="also draw --out/timeline.png: compute and communication lanes of the "
                        "step before and after, predicted by the cost model (needs matplotlib)")
    i.add_argument("--trace", metavar="FILE",
                   help="draw a torch.profiler chrome trace's compute and collective lanes as "
                        "--out/trace_timeline.png (needs matplotlib); --model is optional then")
    i.set_defaults(fn=cmd_inspect, check=checks.check_inspect)

    b = sub.add_parser("bench", help="step latency of eager, Inductor, Inductor's bucketing, "
                                     "hand-merged code and fxcoalesce, side by side on real ranks")
    b.add_argument("--model", default="neox-tiny", help="model name (default: %(default)s)")
    b.add_argument("--step", default="forward", choices=["forward", "verify"],
                   help="forward: prefill; verify: EAGLE-3 tree verification after a cached "
                        "prefix (dense models, which have no cache: their plain forward) "
                        "(default: %(default)s)")
    b.add_argument("--tp", type=int, default=2,
                   help="ranks, one process each (default: %(default)s)")
    b.add_argument("--tokens", type=_int_list, default=(3,),
                   help="tokens per step; a list such as 3,16,64 measures each in turn "
                        "(default: 3)")
    b.add_argument("--layers", type=int,
                   help="override the model's number of layers (default: the model's own)")
    b.add_argument("--dim", type=int,
                   help="override the model's hidden size; MLP widths (and a dense model's "
                        "heads, at the same head size) scale with it (default: its own)")
    b.add_argument("--backend", choices=["gloo", "nccl"],
                   help="process group backend (default: nccl with --device cuda and a GPU "
                        "per rank, else gloo)")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where weights (bf16 on cuda, fp32 on cpu) and activations live "
                        "(default: %(default)s)")
    b.add_argument("--cudagraphs", action="store_true",
                   help="compile every variant with mode='reduce-overhead' (CUDA graphs)")
    b.add_argument("--nccl-mode", choices=["nvlink", "p2p-off"],
                   help="NCCL only: p2p-off sets NCCL_P2P_DISABLE=1 (traffic through host "
                        "memory, like a PCIe box without peer-to-peer) (default: nvlink)")
    b.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated variants to run, of: " + ", ".join(VARIANTS) + ". "
                        "inductor-one-shot is torch.compile with PyTorch's own one-shot "
                        "lowering (CUDA + NCCL only, else skipped); no-comm replaces every "
                        "all_reduce by a local scale: wrong results by design, the floor "
                        "each variant's exposed_comm_ms is measured from, never a default "
                        "(default: %(default)s)")
    b.add_argument("--steps", type=int, default=100,
                   help="timed rounds; each calls every variant once (default: %(default)s)")
    b.add_argument("--calls-per-sample", type=int,
                   help="calls of a variant timed together in one sample, divided by it: "
                        "steps back to back as in a decode loop, without a barrier's skew "
                        "between ranks in every sample (default: 10 on cuda, 1 on cpu)")
    b.add_argument("--warmup", type=int, default=10,
                   help="untimed rounds after compiling (at least 3 with --cudagraphs) "
                        "(default: %(default)s)")
    b.add_argument("--out", help="directory to write bench.json, bench.md and bench.png into, "
                                 "created if missing (default: write nothing)")
    b.add_argument("--trace", action="store_true",
                   help="after timing, profile 5 more calls of each compiled variant and write "
                        "rank 0's chrome trace as --out/trace_<variant>_t<tokens>.json "
                        "('inspect --trace FILE' draws one); bench.json gets each one's "
                        "collective time and the part no compute overlapped")
    b.set_defaults(fn=cmd_bench, check=checks.check_bench)

    d = sub.add_parser("demo", help="the main job: a model whose all_reduces fxcoalesce "
                                    "merges, timed against plain torch.compile, then EAGLE-3 "
                                    "speculative decoding of SmolLM2-135M (on a CPU: a greedy "
                                    "step timed against the smallest tree's)")
    d.add_argument("--tp", type=int, default=2,
                   help="ranks, one process each (default: %(default)s)")
    d.add_argument("--tokens", type=int,
                   help=f"new tokens of SmolLM2's answer, at least 2 (default: {TOKENS}; it "
                        "stops earlier at EOS)")
    d.add_argument("--backend", choices=["gloo", "nccl"],
                   help="process group backend (default: nccl with --device cuda and a GPU "
                        "per rank, else gloo)")
    d.add_argument("--codegen", choices=["inductor", "eager"],
                   help="code generator of SmolLM2's compiled steps, where it decodes "
                        "speculatively (default: inductor on GPUs; eager on CPU, where "
                        "Inductor takes minutes over 30 layers)")
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where weights and activations live (default: %(default)s)")
    d.add_argument("--out", help="directory to write demo.json into, created if missing "
                                 "(default: write nothing)")
    d.add_argument("--prompt", help="what SmolLM2 is asked, chat template applied "
                                    f"(default: {DEFAULT_PROMPT!r})")
    d.add_argument("--draft", help="SmolLM2's draft head directory from train-draft "
                                   "(default: the repository's heads/smollm2-135m)")
    d.add_argument("--tree", metavar="auto|measure|spec|greedy|K,D,N",
                   help="decode SmolLM2 speculatively (on a GPU always; on a CPU only with "
                        "--tree: minutes) with this tree: auto sizes it from the step times "
                        "measured on this machine and the head's acceptance (the decision "
                        "kept per machine, model, head and TP degree), greedy where no tree "
                        "is faster; measure: anew; spec: the fastest tree even where greedy "
                        "is faster; greedy; or K,D,N: top-k, depth, total tokens (default on "
                        "a GPU: auto)")
    d.set_defaults(fn=cmd_demo, check=checks.check_demo)

    t = sub.add_parser("train-draft", help="train an EAGLE-3 draft head for a pretrained target "
                                           "by self-distillation")
    t.add_argument("--target", default="smollm2-135m",
                   help="target model with pretrained weights (default: %(default)s)")
    t.add_argument("--out", required=True,
                   help="directory for the head: config.json, safetensors shards, train_log.json")
    t.add_argument("--device", choices=["cpu", "cuda"],
                   help="where to train (default: cuda if torch sees one, else cpu)")
    t.add_argument("--minutes", type=float, default=5.0,
                   help="wall-time budget for generating data and training together, loading "
                        "aside (default: %(default)s)")
    t.add_argument("--gen-share", type=float, default=0.4,
                   help="share of --minutes after which generation starts no new batch "
                        "(default: %(default)s)")
    t.add_argument("--prompts", type=int,
                   help="use only the first N training prompts (default: all, ~19k)")
    t.add_argument("--gen-batch", type=int, default=256,
                   help="prompts answered together (default: %(default)s)")
    t.add_argument("--gen-tokens", type=int, default=256,
                   help="longest response generated (default: %(default)s)")
    t.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft vocabulary size (default: %(default)s)")
    t.add_argument("--ttt-steps", type=int, default=7,
                   help="unrolled draft steps in training (default: %(default)s)")
    t.add_argument("--batch-tokens", type=int, default=16384,
                   help="token positions per optimizer step (default: %(default)s)")
    t.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (default: %(default)s)")
    t.add_argument("--epochs", type=float,
                   help="stop after this many passes over the generated data (default: at the "
                        "deadline); at most 1, the last batch's top-1 is on text not yet "
                        "trained on")
    t.add_argument("--held-out", type=int, default=16,
                   help="held-out prompts the finished head is scored on, as training scores "
                        "its last batch (train_log.json: held_out_top1; 0: none; default: "
                        "%(default)s)")
    t.set_defaults(fn=cmd_train_draft, check=checks.check_train_draft)

    c = sub.add_parser("calibrate", help="measure all_reduce latency on real ranks and fit "
                                         "the cost model (profile.json)")
    c.add_argument("--tp", type=int, default=2,
                   help="ranks (default: %(default)s); 1 with --backend nccl measures what "
                        "each implementation costs a call at world size 1")
    c.add_argument("--backend", choices=["gloo", "nccl"],
                   help="process group backend (default: gloo)")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the reduced tensors live (default: %(default)s)")
    c.add_argument("--nccl-mode", default="nvlink", choices=["nvlink", "p2p-off"],
                   help="NCCL only: p2p-off sets NCCL_P2P_DISABLE=1 (traffic through host "
                        "memory, like a PCIe box without peer-to-peer) (default: %(default)s)")
    c.add_argument("--max-bytes", default="64M",
                   help="largest all_reduce, e.g. 16M, at most 1G: every size up to it is held "
                        "at once on each rank, about 3.5 times this (default: %(default)s)")
    c.add_argument("--budget", type=float, default=1.0,
                   help="seconds of timing per size, roughly, shared by the implementations "
                        "measured (default: %(default)s)")
    c.add_argument("--no-cudagraphs", action="store_true",
                   help="CUDA: time an eager loop instead of a captured CUDA graph")
    c.add_argument("--impls",
                   help="NCCL on CUDA: the implementations to measure beside NCCL, any of "
                        f"{', '.join(checks.CALIBRATE_IMPLS[1:])} (default: "
                        "one_shot,two_shot,fused_add_rms_norm; none on gloo; nccl_symm, "
                        "NCCL's own symmetric kernels, only in a run of its own: it sets a "
                        "process-wide symmetric-memory backend)")
    c.add_argument("--out", required=True, help="profile JSON to write")
    c.set_defaults(fn=cmd_calibrate, check=checks.check_calibrate)

    o = sub.add_parser("doctor", help="what this torch gives fxcoalesce: its version beside "
                                      "the tested range, a canary for each torch internal "
                                      "fxcoalesce relies on, GPUs, NCCL, symmetric memory, "
                                      "the cache directories (exit status 1 if a canary fails)")
    o.set_defaults(fn=cmd_doctor, check=lambda args: None)
    # argparse takes "-5M" for an option unless it looks like a number: let the check say why
    # a negative size is wrong (Python 3.13 already matches it; 3.11 does not)
    c._negative_number_matcher = checks.NEGATIVE_SIZE
    for command in _commands(p).values():  # -v / -q after the command too (inspect -q ...)
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="as fxcoalesce -v: log each graph's report; show a failed "
                                  "rank's traceback")
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                             help="as fxcoalesce -q: no progress lines on stderr")
    return p


def _error(cmd: str, message: str) -> None:
    print(f"fxcoalesce {cmd}: error: {message}", file=sys.stderr)


def _run(args) -> int:
    """Run the checked subcommand; a failed rank becomes one line and exit status 1 (a
    failure at run time, not bad input), with its traceback first under -v."""
    from fxcoalesce.apps.launch import RankError

    from fxcoalesce.apps.spec.smollm2 import WeightsError

    try:
        return args.fn(args)
    except WeightsError as e:  # the weights cannot be had: not bad input, but one line
        _error(args.cmd, str(e))
        return 1
    except RankError as e:
        hint = ""
        if args.verbose:
            print(e.traceback, end="", file=sys.stderr)
        elif e.traceback:
            hint = f" (fxcoalesce -v {args.cmd} ... shows its traceback)"
        _error(args.cmd, str(e).splitlines()[0] + hint)
        return 1


class _NamedOnce(logging.Formatter):
    """``logger: message``, unless the message already starts with "fxcoalesce" (the
    library's messages name themselves: ``fxcoalesce[graph 0]: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("fxcoalesce") else f"{record.name}: {text}"


def _commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name."""
    return next(a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction))


def _parse(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``p.parse_args(argv)``, except that an argument no parser takes is refused by the
    parser of the command it was given to, with that command's usage (argparse's own refusal
    shows the top-level usage), and the closest option: ``inspect --tpp 2``: did you mean
    --tp?"""
    args, extra = p.parse_known_args(argv)
    if not extra:
        return args
    first = extra[0]
    before_command = first in argv and argv.index(first) < argv.index(args.cmd)
    own = p if before_command else _commands(p)[args.cmd]
    options = [o for a in own._actions for o in a.option_strings if o.startswith("--")]
    top = [o for a in p._actions for o in a.option_strings]
    name = first.partition("=")[0]
    if own is not p and name in top:
        hint = (f"an option of fxcoalesce itself: give it before the command, fxcoalesce "
                f"{name} {args.cmd} ...")
    elif first.startswith("-"):
        hint = did_you_mean(name, options, quote=False)
    elif own is not p and "--model" in options and getattr(args, "model", "") is None:
        hint = f"did you mean --model {first}?"
    else:
        hint = ""
    own.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({hint})" if hint else ""))


def main(argv: list[str] | None = None) -> int:
    """The ``fxcoalesce`` command; its exit status. Ctrl-C anywhere is one line and 130."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:
        args = _parse(parser(), argv)
        return _main(args, argv)
    except KeyboardInterrupt:
        cmd = f" {args.cmd}" if args is not None else ""
        print(f"fxcoalesce{cmd}: interrupted", file=sys.stderr, flush=True)
        return 130


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    args.command_line = "fxcoalesce " + " ".join(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_NamedOnce("%(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        handlers=[handler])
    try:
        args.check(args)
        return _run(args)
    except ValueError as e:  # bad input, found by the checks or in this process: one line
        _error(args.cmd, str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
