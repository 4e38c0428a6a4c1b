"""``fxcoalesce demo`` without ``--model``: the two things fxcoalesce is for, on this machine,
in a few minutes.

1. Merging. ``neox-tiny`` (GPT-NeoX-style parallel blocks: attention and MLP read one norm,
   so each layer's two all_reduces sum into one) on real ranks, plain ``torch.compile``
   against fxcoalesce, measured by ``bench``: the same processes and weights, alternating
   rounds after a barrier, a step's time the slowest rank's, medians with their p10-p90
   spread; launches counted at run time by the profiler.
2. Speculative decoding of a real model. SmolLM2-135M-Instruct (its weights fetched once)
   answers a prompt with its trained EAGLE-3 head (``heads/smollm2-135m``), the speculative
   step (draft tree, verify, accept) compiled through the pipeline, and against its own
   greedy decoding: the text, the accepted length, whether the tokens are greedy's, and the
   report's verdict on the step's all_reduces (a sequential model: at its bound).

What the pass costs is measured where it is spent, inside each compile (the report's
``pass_cost_ms``: its pipeline and the ranks' agreement); a compile's total time follows the
machine's load and what compiled before it in the process, so it is not compared here.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fxcoalesce.apps.defaults import DEFAULT_PROMPT, MERGE_MODEL, backend_of

MERGE_TOKENS = 3
MERGE_ROUNDS = 500
TOUR_TOKENS = 64
"""New tokens of SmolLM2's answer (``--tokens`` changes it)."""
RECORDED_GPU = "benchmarks/results/gpu_h200x2_2026-11-30/spec_tp2.json"
"""SmolLM2 with the same head and tree on two H200s: what a GPU makes of the same step."""
DISPLAY = "SmolLM2-135M-Instruct"


def _spread(v: dict) -> str:
    """'8.25 ms (4.55-16.34)': a variant's median step time and its p10-p90 range."""
    return f"{v['median_ms']:.2f} ms ({v['p10_ms']:.2f}-{v['p90_ms']:.2f})"


def merge_part(args, say) -> dict:
    """Part 1: the bench record of plain torch.compile against fxcoalesce on MERGE_MODEL."""
    from fxcoalesce.apps.bench.run import BenchOptions, run_bench

    cuda = args.device == "cuda"
    opt = BenchOptions(model=MERGE_MODEL, tokens=(MERGE_TOKENS,), tp=args.tp,
                       backend=backend_of(args), device=args.device, cudagraphs=cuda,
                       variants=("inductor", "fxcoalesce"), steps=MERGE_ROUNDS,
                       calls_per_sample=10 if cuda else 1, warmup=10,
                       command=getattr(args, "command_line", ""), progress=say is not None)
    return run_bench(opt)[0]


def row(label: str, value: str) -> str:
    """'  label ... : value', labels aligned as the SmolLM2 lines align theirs."""
    return f"  {label:<33}: {value}"


def merge_lines(rec: dict) -> list[str]:
    """What part 1 found, one figure a line, every figure from the bench record."""
    from fxcoalesce import models
    from fxcoalesce.apps.bench.report import within_noise

    from fxcoalesce.apps.spec.demo import pass_cost_text

    plain, ours = rec["variants"]["inductor"], rec["variants"]["fxcoalesce"]
    reports = ours.get("report_all_reduce") or [{}]
    layers = models.args_of(MERGE_MODEL).n_layers
    noise = ("the ranges overlap: within noise" if within_noise(ours, plain)
             else "the ranges do not overlap")
    lines = [
        f"{MERGE_MODEL}, {layers} parallel blocks (attention and MLP off one norm), random "
        f"weights, a forward over {rec['tokens']} tokens, TP {rec['tp']} ({rec['backend']}, "
        f"{rec['device']})",
        row("all_reduce launches per step", f"{plain['all_reduce_launches']} plain "
            f"torch.compile -> {ours['all_reduce_launches']} fxcoalesce (counted at run time; "
            f"lower bound {reports[0].get('lower_bound', '?')})"),
        row("all_reduce bytes per step", f"{plain['bytes']} -> {ours['bytes']}"),
        row("step time, median (p10-p90)", f"{_spread(plain)} plain torch.compile, "
            f"{_spread(ours)} fxcoalesce: {plain['median_ms'] / ours['median_ms']:.2f}x, "
            f"{noise}"),
        row("how it was timed", f"{rec['steps']} rounds after {rec['warmup']} untimed, both "
            "in each round, alternating, a step the slowest rank's"),
        row("output, max |Δ| from eager", f"{plain['max_abs_err']:.2g} plain, "
            f"{ours['max_abs_err']:.2g} fxcoalesce (floating-point summation order)")]
    if ours.get("report_pass_ms"):
        costs = ours["report_pass_ms"]
        total = {k: sum(c[k] for c in costs) for k in costs[0]}
        lines.append(row("fxcoalesce inside the compile", f"{pass_cost_text(total)} for its "
                         f"{len(costs)} graph{'s' * (len(costs) > 1)}; a compile's total "
                         "follows the load: not compared"))
    return lines


def recorded_gpu_line() -> str | None:
    """The same head and tree as recorded on GPUs (``RECORDED_GPU``), as a labelled line."""
    path = Path(__file__).resolve().parents[2] / RECORDED_GPU
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    return row(f"recorded on {d['tp']} x {str(d['device']).removeprefix('NVIDIA ')}",
               f"{d['speedup_vs_target_greedy']:.2f}x over greedy, accepted length "
               f"{d['mean_accepted']:.2f}, TP {d['tp']}, CUDA graphs, {d['prompts']} prompts "
               f"[{RECORDED_GPU}]")


def run_tour(args) -> int:
    from fxcoalesce.apps.spec.demo import decode_smollm2, smollm2_lines
    from fxcoalesce.apps.spec.smollm2 import NAME

    say = None if getattr(args, "quiet", False) else (
        lambda text: print(text, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    if say:
        say(f"fxcoalesce demo: 1/2 merging ({MERGE_MODEL}, plain torch.compile against "
            f"fxcoalesce), 2/2 EAGLE-3 on {NAME}; a few minutes on 2 CPU cores")
    rec = merge_part(args, say)
    part1 = merge_lines(rec)
    print("1/2 merging all_reduces: " + part1[0])
    print("\n".join(part1[1:]), flush=True)
    prompt = args.prompt or DEFAULT_PROMPT
    run = decode_smollm2(prompt=prompt, tokens=args.tokens or TOUR_TOKENS, tp=args.tp,
                         device=args.device, backend=args.backend, codegen=args.codegen,
                         draft=args.draft)
    print(f"\n2/2 EAGLE-3 speculative decoding of a real model: {DISPLAY}, pretrained, "
          f"with its trained draft head, TP {args.tp} ({run.summary['backend']}, "
          f"{run.summary['device']}), codegen {run.options.codegen}")
    print(f"\n  {prompt}\n")
    for line in run.text.splitlines():
        print(f"  {line}" if line else "")
    print()
    for line in smollm2_lines(run, args.tp):
        print(f"  {line}")
    if args.device == "cpu" and (gpu := recorded_gpu_line()):
        print(gpu)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    if getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"merge": rec, "speculative": {**run.summary, "text": run.text,
                                              "prompt": prompt}}
        (out / "demo.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {out / 'demo.json'}")
    return 0
