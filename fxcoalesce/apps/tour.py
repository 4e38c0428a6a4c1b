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
   report's verdict on the step's all_reduces (a sequential model: at its bound). The
   greedy baseline runs uncompiled on a CPU (as fast there, within noise; one compile fewer).
   The tree is sized from this machine's measured step times and the head's acceptance
   (``spec.treechoice``, ``--tree``); where no tree beats greedy (2 CPU cores), it says so
   with the measured reason and decodes greedily, the greedy step compiled through
   fxcoalesce: never slower than greedy.

Both parts run in the same rank processes (``tour_worker``): one start, and the compilers'
one-time costs paid once. Then how to ask the same of one's own model (``fxcoalesce
inspect``), with what it says of a zoo model, traced here under fake tensors in seconds
(``INSPECT_EXAMPLE``).

What the pass costs is measured where it is spent, inside each compile (the report's
``pass_cost_ms``: its pipeline and the ranks' agreement); a compile's total time follows the
machine's load and what compiled before it in the process, so it is not compared here (nor
warmed up for: bench's untimed warm-up compile is skipped). Rank 0 says on stderr what it
compiles and decodes, a line at least every 10 s (``apps.progress``).
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
WARMUP_TOKENS_CPU = 4
"""The untimed first decoding on a CPU: it compiles the speculative step (no CUDA graphs to
record, so a few tokens are enough)."""
INSPECT_MODEL, INSPECT_LAYERS, INSPECT_TP = "falcon-40b", 2, 8
INSPECT_EXAMPLE = (f"fxcoalesce inspect --model {INSPECT_MODEL} --layers {INSPECT_LAYERS} "
                   f"--tp {INSPECT_TP}")
"""The command whose result the demo's last line shows, traced in the demo's own process
as the command traces it (tests/test_tour.py checks the line against the command's output)."""
RECORDED_GPU = "benchmarks/results/gpu_h100x1_torch2.11_2026-12-06_session15/tree_8-7-96/spec_tp1.json"
"""SmolLM2 with the same head on one H100 (32 prompts, the lower of two runs of the newest code
measured there: 1089409, launch ahead; the tree (8, 7, 96) forced, the deepest that paid;
(8, 6, 64), what the sizing picks, ran 2.08x beside it: COMMAND.txt): what a GPU makes of the
same decoding. Not the two-H200 TP-2 record of 2026-11-30: Inductor before torch 2.15 compiled
that step wrong (docs/measurements.md)."""
DISPLAY = "SmolLM2-135M-Instruct"


def _spread(v: dict) -> str:
    """'8.25 ms (4.55-16.34)': a variant's median step time and its p10-p90 range."""
    return f"{v['median_ms']:.2f} ms ({v['p10_ms']:.2f}-{v['p90_ms']:.2f})"


def merge_options(args, say):
    """Part 1's bench options: plain torch.compile against fxcoalesce on MERGE_MODEL."""
    from fxcoalesce.apps.bench.run import BenchOptions

    cuda = args.device == "cuda"
    return BenchOptions(model=MERGE_MODEL, tokens=(MERGE_TOKENS,), tp=args.tp,
                        backend=backend_of(args), device=args.device, cudagraphs=cuda,
                        variants=("inductor", "fxcoalesce"), steps=MERGE_ROUNDS,
                        calls_per_sample=10 if cuda else 1, warmup=10,
                        command=getattr(args, "command_line", ""), progress=say is not None,
                        warm_up_compilers=False)


def tour_worker(rank: int, world: int, bench_opt, spec_opt) -> dict:
    """One rank of both parts, in one process: part 1 (``bench_worker``), whose lines rank 0
    prints as soon as every rank's times are in, then part 2 (``spec_worker``). One process
    start per rank and one payment of the compilers' one-time costs, not two."""
    import torch
    import torch.distributed as dist

    from fxcoalesce.apps.bench.records import environment, merge_ranks
    from fxcoalesce.apps.bench.run import bench_worker
    from fxcoalesce.apps.spec.specdecode import spec_worker

    mine = bench_worker(rank, world, bench_opt)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    rec = None
    if rank == 0:
        rec = merge_ranks(every, bench_opt, environment(bench_opt.device))[0]
        part1 = merge_lines(rec)
        print("1/2 merging all_reduces: " + part1[0])
        print("\n".join(part1[1:]), flush=True)
    torch._dynamo.reset()  # part 1's graphs are not looked at again
    return {"merge": rec, "spec": spec_worker(rank, world, spec_opt)}


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
    from fxcoalesce.apps.spec.treechoice import key_of

    path = Path(__file__).resolve().parents[2] / RECORDED_GPU
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    t = d.get("tree")
    tree = key_of((t["top_k"], t["depth"], t["total_tokens"])) if t else "none"
    return row(f"recorded on {d['tp']} x {str(d['device']).removeprefix('NVIDIA ').split()[0]}",
               f"{d['speedup_vs_target_greedy']:.2f}x over greedy, accepted length "
               f"{d['mean_accepted']:.2f}, tree ({tree}), TP {d['tp']}, "
               f"CUDA graphs, {d['prompts']} prompts "
               f"[{RECORDED_GPU}]")


def inspect_example(say=None) -> tuple[str, float]:
    """(the launches and verdict ``INSPECT_EXAMPLE`` prints, its trace's seconds), traced in
    this process as the command traces it (fake tensors, a fake group), with the options the
    command line gives it and inspect's defaults for the rest."""
    from types import SimpleNamespace

    from fxcoalesce.apps.inspect.command import launches_text, trace
    from fxcoalesce.config import Config

    args = SimpleNamespace(model=INSPECT_MODEL, layers=INSPECT_LAYERS, tp=INSPECT_TP, hf=None,
                           tokens=3, step="forward", hand_merged=False, profile=None,
                           bucket_cap_mb=Config().bucket_cap_mb, verbose=False)
    traced, _ = trace(args, say or (lambda text: None))
    r = traced.report
    return f"all_reduce launches  {launches_text(r.all_reduce)}, {r.verdict}", traced.seconds


def inspect_lines(found: str, seconds: float) -> list[str]:
    """The demo's last lines: how to ask of one's own model, and what a zoo model gave."""
    doors = [("fxcoalesce inspect --model path/to/file.py:factory --tp N",
              "factory() returns (module, TP plan, input shape)"),
             ("fxcoalesce inspect --hf <model type or config.json> --tp N",
              "a Hugging Face architecture (the hf extra)"),
             (INSPECT_EXAMPLE, f"traced just now, {seconds:.1f} s: {found}")]
    width = max(len(command) for command, _ in doors)
    return ["Your own model: `fxcoalesce inspect` says what fxcoalesce would merge in it, in "
            "seconds, with no weights and no GPU (fake tensors, a fake group of N ranks):"] + [
        f"  {command:<{width}}   {what}" for command, what in doors]


def run_tour(args) -> int:
    from fxcoalesce.apps.bench.calibrate import NCCL_MODES
    from fxcoalesce.apps.launch import spawn
    from fxcoalesce.apps.spec.demo import prepare_smollm2, smollm2_lines, tree_arg
    from fxcoalesce.apps.spec.smollm2 import NAME

    say = None if getattr(args, "quiet", False) else (
        lambda text: print(text, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    cuda = args.device == "cuda"
    if say:
        say(f"fxcoalesce demo: 1/2 merging ({MERGE_MODEL}, plain torch.compile against "
            f"fxcoalesce), 2/2 EAGLE-3 on {NAME}, then what `fxcoalesce inspect` says of a "
            "model; about 2 minutes on 2 CPU cores, longer on a busy machine")
    prompt = args.prompt or DEFAULT_PROMPT
    job = prepare_smollm2(prompt=prompt, tokens=args.tokens or TOUR_TOKENS,
                          device=args.device, codegen=args.codegen, draft=args.draft,
                          quiet=say is None, warmup_tokens=16 if cuda else WARMUP_TOKENS_CPU,
                          greedy_compiled=cuda, tree=tree_arg(args) or "auto")
    bench_opt = merge_options(args, say)
    be = bench_opt.backend
    if say:
        say(f"starting {args.tp} {be} rank{'s' * (args.tp > 1)} for both parts; part 2: "
            f"{job.describe(args.tp)}")
    env = NCCL_MODES.get(bench_opt.nccl_mode, {}) if be == "nccl" else {}
    ranks = spawn(tour_worker, args.tp, (bench_opt, job.options), backend=be, env=env)
    rec = ranks[0]["merge"]
    run = job.finish([r["spec"] for r in ranks])
    print(f"\n2/2 EAGLE-3 speculative decoding of a real model: {DISPLAY}, pretrained, "
          f"with its trained draft head, TP {args.tp} ({run.summary['backend']}, "
          f"{run.summary['device']}), codegen {run.options.codegen}")
    print(f"  Q: {prompt}")
    for i, line in enumerate(run.text.splitlines()):
        print(f"  {'   ' if i else 'A: '}{line}" if line else "")
    print()
    for line in smollm2_lines(run, args.tp):
        print(f"  {line}")
    if args.device == "cpu" and (gpu := recorded_gpu_line()):
        print(gpu, flush=True)
    found, seconds = inspect_example(say)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    print("\n".join(inspect_lines(found, seconds)))
    if getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"merge": rec, "speculative": {**run.summary, "text": run.text,
                                              "prompt": prompt},
                "inspect": {"command": INSPECT_EXAMPLE, "found": found,
                            "trace_s": round(seconds, 2)}}
        (out / "demo.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {out / 'demo.json'}")
    return 0
