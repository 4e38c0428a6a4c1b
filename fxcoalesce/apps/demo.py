"""``fxcoalesce demo``: the two things fxcoalesce is for, on this machine, in about two minutes.

1. Merging. ``neox-tiny`` (GPT-NeoX-style parallel blocks: attention and MLP read one norm,
   so each layer's two all_reduces sum into one) on real ranks, plain ``torch.compile``
   against fxcoalesce, measured by ``bench``: the same processes and weights, alternating
   rounds after a barrier, a step's time the slowest rank's; launches counted at run time
   by the profiler. Launches and bytes come first, then the step times, and "faster" is the
   round-by-round sign test of ``bench.report`` (a round's two steps share its load; the
   p10-p90 ranges of a shared machine overlap whatever the difference).
2. EAGLE-3 on a real model: SmolLM2-135M-Instruct (its weights fetched once) with its
   trained head (``heads/smollm2-135m``). On a GPU, or with ``--tree`` on a CPU, it answers
   the prompt speculatively, the tree sized from this machine's step times
   (``spec.treechoice``), every step compiled through fxcoalesce, against its own greedy
   decoding (``specdecode.spec_worker``). On a CPU a tree's step costs more than the tokens
   it adds (compute grows with the tokens verified), so by default it only measures that,
   in seconds: the answer decoded greedily, the smallest tree's accepted length along it, a
   greedy step against that tree's step round by round (``specdecode.race_worker``); then
   the same head's decoding as recorded on a GPU (``RECORDED_GPU``).

Both parts run in the same rank processes (``demo_worker``): one start, and the compilers'
one-time costs paid once. Then how to ask the same of one's own model (``fxcoalesce
inspect``), with what it says of a zoo model, traced here under fake tensors in seconds
(``INSPECT_EXAMPLE``). What the pass costs is measured inside each compile (the report's
``pass_cost_ms``); a compile's total follows the machine's load, so it is not shown. Rank 0
says on stderr what it compiles and measures, a line at least every 10 s (``apps.progress``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from fxcoalesce.apps.defaults import DEFAULT_PROMPT, MERGE_MODEL, backend_of

MERGE_TOKENS = 3
MERGE_ROUNDS = 500
TOKENS = 64
"""New tokens of SmolLM2's answer (``--tokens`` changes it)."""
WARMUP_TOKENS = {"cuda": 16, "cpu": 4}
"""The untimed first decoding of the full path: it compiles the steps (and on a GPU records
their CUDA graphs; a CPU has none to record, so a few tokens are enough)."""
INSPECT_MODEL, INSPECT_LAYERS, INSPECT_TP = "falcon-40b", 2, 8
INSPECT_EXAMPLE = (f"fxcoalesce inspect --model {INSPECT_MODEL} --layers {INSPECT_LAYERS} "
                   f"--tp {INSPECT_TP}")
"""The command whose result the demo's last line shows, traced in the demo's own process
as the command traces it (tests/test_demo.py checks the line against the command's output)."""
RECORDED_GPU = "benchmarks/results/gpu_h100x1_torch2.11_2026-12-06_session15/tree_8-7-96/spec_tp1.json"
"""SmolLM2 with the same head on one H100 (32 prompts, the lower of two runs of the newest code
measured there: 1089409, launch ahead; the tree (8, 7, 96) forced, the deepest that paid;
(8, 6, 64), what the sizing picks, ran 2.08x beside it: COMMAND.txt): what a GPU makes of the
same decoding. Not the two-H200 TP-2 record of 2026-11-30: Inductor before torch 2.15 compiled
that step wrong (docs/measurements.md)."""
DISPLAY = "SmolLM2-135M-Instruct"


def row(label: str, value: str) -> str:
    """'  label ... : value', the labels aligned."""
    return f"  {label:<33}: {value}"


def pass_cost_text(cost: dict) -> str:
    """'41.5 ms (pipeline 30.4 ms, agreeing 11.1 ms)' from ``Report.pass_cost_ms()``."""
    agreeing = cost["ladder"] + cost["exchange"]
    return (f"{cost['total']:.1f} ms (pipeline {cost['pipeline']:.1f} ms"
            + (f", agreeing {agreeing:.1f} ms" if agreeing else "") + ")")


# --- part 1: merging ----------------------------------------------------------------------

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


def verdict(ours: dict, plain: dict) -> str:
    """fxcoalesce against plain torch.compile, round by round (``bench.report.faster``)."""
    from fxcoalesce.apps.bench.report import ALPHA, paired, sign_test

    pair = paired(ours, plain)
    if pair is None:
        return "not judged: the rounds' steps were not kept"
    _, k, n = pair
    won, lost = sign_test(k, n), sign_test(n - k, n)
    if won < ALPHA:
        return f"faster in {k} of {n} rounds (sign test p = {won:.2g})"
    if lost < ALPHA:
        return (f"slower: plain torch.compile faster in {n - k} of {n} rounds (sign test p = "
                f"{lost:.2g})")
    return f"not faster beyond the noise (faster in {k} of {n} rounds, sign test p = {won:.2g})"


def merge_lines(rec: dict) -> list[str]:
    """What part 1 found, one figure a line, every figure from the bench record."""
    from fxcoalesce import models

    plain, ours = rec["variants"]["inductor"], rec["variants"]["fxcoalesce"]
    reports = ours.get("report_all_reduce") or [{}]
    layers = models.args_of(MERGE_MODEL).n_layers
    lines = [
        f"{MERGE_MODEL}, {layers} parallel blocks (attention and MLP off one norm), random "
        f"weights, a forward over {rec['tokens']} tokens, TP {rec['tp']} ({rec['backend']}, "
        f"{rec['device']})",
        row("all_reduce launches per step", f"{plain['all_reduce_launches']} plain "
            f"torch.compile -> {ours['all_reduce_launches']} fxcoalesce (counted at run time; "
            f"lower bound {reports[0].get('lower_bound', '?')})"),
        row("all_reduce bytes per step", f"{plain['bytes']} -> {ours['bytes']}"),
        row("step time, median", f"{plain['median_ms']:.2f} ms plain torch.compile, "
            f"{ours['median_ms']:.2f} ms fxcoalesce "
            f"({plain['median_ms'] / ours['median_ms']:.2f}x)"),
        row("fxcoalesce, round by round", verdict(ours, plain)),
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


# --- part 2: EAGLE-3 on SmolLM2 -----------------------------------------------------------

@dataclass(slots=True)
class SmolJob:
    """A checked SmolLM2 decoding, before any rank starts: the ranks' options and the
    tokenizer that reads their answer."""

    options: object
    """``specdecode.SpecOptions``."""
    tokenizer: object
    """``smollm2.ChatTokenizer``."""
    full: bool
    """Decode speculatively (``spec_worker``), else the CPU's short look (``race_worker``)."""


def smollm2_job(args, prompt: str) -> SmolJob:
    """Check the head and the prompt, fetch and check the weights (once), tokenize: what the
    ranks need, or the ValueError / WeightsError that says what is wrong."""
    from fxcoalesce.apps.spec import smollm2
    from fxcoalesce.apps.spec.draft_head import check_compatible, head_path, read_config
    from fxcoalesce.apps.spec.specdecode import SpecOptions
    from fxcoalesce.apps.spec.treechoice import parse_tree
    from fxcoalesce.models import llama

    target_args = llama.CONFIGS[smollm2.NAME]
    head = head_path(args.draft)
    check_compatible(read_config(head), head, smollm2.NAME, target_args)
    gguf = smollm2.gguf_path()
    tok = smollm2.ChatTokenizer(smollm2.read_gguf(gguf))
    ids = tok.encode_chat(prompt)
    cuda = args.device == "cuda"
    tree = parse_tree(args.tree) if args.tree is not None else "auto"
    tokens = args.tokens or TOKENS
    opt = SpecOptions(gguf=str(gguf), draft=str(head), prompts=(tuple(ids),),
                      tokens=tokens, device=args.device,
                      codegen=args.codegen or ("inductor" if cuda else "eager"),
                      mode="reduce-overhead" if cuda else None,
                      warmup_tokens=WARMUP_TOKENS[args.device], greedy_compiled=cuda,
                      quiet=getattr(args, "quiet", False), tree=tree, prefill_compiled=cuda)
    if isinstance(tree, tuple):
        k, d, n = tree
        opt = replace(opt, top_k=k, depth=d, total_tokens=n)
    need = len(ids) + tokens + opt.total_tokens
    if need > target_args.max_seq_len:
        raise ValueError(f"the prompt is {len(ids)} tokens (chat template included); with "
                         f"--tokens {tokens} and a tree of {opt.total_tokens} it needs {need} "
                         f"positions, past {smollm2.NAME}'s context of {target_args.max_seq_len}")
    return SmolJob(opt, tok, full=cuda or args.tree is not None)


def race_lines(ranks: list[dict], answer_tokens: int) -> list[str]:
    """What the CPU's short look measured, the verdict first: a greedy step against the
    smallest tree's, that tree's accepted length along the answer, round by round."""
    from fxcoalesce.apps.bench.report import ALPHA, sign_test

    r = ranks[0]
    g, t = r["greedy_step_s"], r["tree_step_s"]
    acc, steps = r["accepted"]["accepted_length"], r["accepted"]["steps"]
    greedy_rate, tree_rate = 1 / g, acc / t
    n = len(r["rounds"])
    k = sum(ts > acc * gs for gs, ts in r["rounds"])  # rounds greedy yields more tokens/s
    won, lost = sign_test(k, n), sign_test(n - k, n)
    rates = f"{greedy_rate:.1f} tokens/s greedy, {tree_rate:.1f} with the smallest tree"
    if won < ALPHA:
        found = (f"greedy decoding is faster, {greedy_rate / tree_rate:.2f}x: {rates} (in {k} "
                 f"of {n} rounds, sign test p = {won:.2g})")
    elif lost < ALPHA:
        found = (f"the smallest tree is faster, {tree_rate / greedy_rate:.2f}x: {rates} (in "
                 f"{n - k} of {n} rounds, sign test p = {lost:.2g})")
    else:
        found = (f"neither is faster beyond the noise: {rates} (greedy faster in {k} of {n} "
                 f"rounds, sign test p = {won:.2g})")
    _, depth, verified = r["tree"]
    return [
        row("measured here", found),
        row("a greedy step, median", f"{g * 1e3:.0f} ms for 1 token"),
        row("the smallest tree's step, median", f"{t * 1e3:.0f} ms ({depth} draft token"
            f"{'s' * (depth > 1)}, {verified} verified) for {acc:.2f} tokens, its accepted "
            f"length along the answer below ({round((acc - 1) * steps)} draft tokens accepted "
            f"in {steps} steps)"),
        row("how it was timed", f"{n} rounds after the prompt, a greedy step then the tree's "
            "in each, uncompiled (the ATen ops fxcoalesce's eager codegen runs on a CPU), the "
            "medians the slowest rank's"),
        row("the answer", f"{answer_tokens} tokens decoded greedily, uncompiled, in "
            f"{r['answer_s']:.1f} s; ranks agree: "
            f"{all(x['tokens'] == r['tokens'] for x in ranks)}"),
        row("decoding speculatively here", "fxcoalesce demo --tree auto (minutes on a CPU: "
            "both steps compiled through fxcoalesce, the tree sized from their step times)")]


def spec_lines(run: dict, result: dict, tp: int, stopped: bool) -> list[str]:
    """The full path's figures, one a line (``specdecode.summarize``'s ``run``, rank 0's
    ``result``): the tree and why, all_reduces and the report's verdict, accepted length,
    tokens/s against greedy, whether the tokens are greedy's, the pass's own time. Where no
    tree was faster the decoding was greedy, and says so."""
    choice = run.get("tree_choice") or {}
    greedy = bool(choice.get("greedy_chosen"))
    lines = []
    if choice:
        lines += [row("tree", f"{choice['label']} ({choice.get('source', 'measured')})"),
                  row("  because", choice["reason"])]
    step = "decode" if greedy and "decode" in run["all_reduce_per_call"] else "spec"
    name = "greedy decode" if step == "decode" else "speculative"
    a, said = run["all_reduce_per_call"].get(step), run["verdict"].get(step)
    if a and tp > 1:
        lines.append(row(f"all_reduce per {name} step", f"{a['before']} -> {a['after']} "
                         f"(lower bound {a['lower_bound']}); the report: {said}"))
    lines.append(row("new tokens", f"{result['spec_tokens']}"
                     f"{' (stopped at EOS)' if stopped else ''}"))
    tps = run["tokens_per_s"]
    if greedy:
        lines += [row("tokens per second", f"{tps['target_greedy']:.1f} greedy, compiled "
                      "through fxcoalesce (chosen: no tree is faster here; prefill included, "
                      "after compilation)")]
    else:
        lines += [
            row("mean accepted length", f"{run['mean_accepted']:.2f} tokens per verify"),
            row("tokens per second", f"{tps['speculative']:.1f} speculative, "
                f"{tps['target_greedy']:.1f} target-only greedy"
                f"{'' if run['settings'].get('greedy_compiled', True) else ', uncompiled'} "
                f"({run['speedup_vs_target_greedy']:.2f}x; prefill included, after compilation)"
                + (f"; greedy took over after {result['greedy_from']} steps, the speculative "
                   "tokens/s so far below greedy's" if result.get("greedy_from") else "")),
            row("tokens equal target greedy", f"{result['same_tokens']}")]
    lines.append(row("ranks agree", f"{run['ranks_agree']}"))
    if cost := run["pass_ms"].get(step):
        lines.append(row("fxcoalesce inside the compile", f"{pass_cost_text(cost)} for the "
                         f"{name} step's graph"))
    return lines


def recorded_gpu_line() -> str | None:
    """The same head's decoding as recorded on a GPU (``RECORDED_GPU``), labelled so."""
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


def demo_worker(rank: int, world: int, bench_opt, spec_opt, full: bool) -> dict:
    """One rank of both parts, in one process: part 1 (``bench_worker``), whose lines rank 0
    prints as soon as every rank's times are in, then part 2 (``spec_worker`` or, on a CPU
    by default, ``race_worker``). One process start per rank and one payment of the
    compilers' one-time costs, not two."""
    import torch
    import torch.distributed as dist

    from fxcoalesce.apps.bench.records import environment, merge_ranks
    from fxcoalesce.apps.bench.run import bench_worker
    from fxcoalesce.apps.spec.specdecode import race_worker, spec_worker

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
    return {"merge": rec, "spec": (spec_worker if full else race_worker)(rank, world, spec_opt)}


# --- the end: one's own model ---------------------------------------------------------------

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


def run_demo(args) -> int:
    from fxcoalesce.apps.bench.calibrate import NCCL_MODES
    from fxcoalesce.apps.launch import spawn
    from fxcoalesce.apps.spec.specdecode import summarize

    say = None if getattr(args, "quiet", False) else (
        lambda text: print(text, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    prompt = args.prompt or DEFAULT_PROMPT
    job = smollm2_job(args, prompt)  # what is wrong with the head or prompt: before any line
    if say:
        say(f"fxcoalesce demo: 1/2 merging ({MERGE_MODEL}, plain torch.compile against "
            f"fxcoalesce), 2/2 EAGLE-3 on {DISPLAY} ("
            + ("decoding speculatively" if job.full else
               "a greedy step against the smallest tree")
            + "), then what `fxcoalesce inspect` says of a model"
            + ("" if job.full else "; about 2 minutes on 2 idle CPU cores, longer on a busy one"))
    bench_opt = merge_options(args, say)
    be = bench_opt.backend
    env = NCCL_MODES.get(bench_opt.nccl_mode, {}) if be == "nccl" else {}
    if say:
        say(f"starting {args.tp} {be} rank{'s' * (args.tp > 1)} for both parts ...")
    ranks = spawn(demo_worker, args.tp, (bench_opt, job.options, job.full), backend=be,
                  env=env)
    rec, spec = ranks[0]["merge"], [r["spec"] for r in ranks]
    tokens = spec[0]["results"][0]["tokens"] if job.full else spec[0]["tokens"]
    text = job.tokenizer.decode(tokens).strip()
    print(f"\n2/2 EAGLE-3 on a real model: {DISPLAY}, pretrained, with its trained draft head, "
          f"TP {args.tp} ({spec[0]['backend']}, {spec[0]['device_name']})"
          + (f", codegen {job.options.codegen}" if job.full else ""))
    if job.full:
        run = summarize(spec[0], spec)
        lines = spec_lines(run, spec[0]["results"][0], args.tp,
                           stopped=tokens[-1] == job.tokenizer.eos_id)
    else:
        run = {k: v for k, v in spec[0].items() if k != "rank"}
        lines = race_lines(spec, len(tokens))
    if args.device == "cpu" and (gpu := recorded_gpu_line()):  # beside what was measured
        lines.insert(len(lines) if job.full else 1, gpu)
    print("\n".join(lines))
    print(f"  Q: {prompt}")
    for i, line in enumerate(text.splitlines()):
        print(f"  {'   ' if i else 'A: '}{line}" if line else "")
    found, seconds = inspect_example(say)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    print("\n".join(inspect_lines(found, seconds)))
    if getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"merge": rec, "speculative": {**run, "text": text, "prompt": prompt},
                "inspect": {"command": INSPECT_EXAMPLE, "found": found,
                            "trace_s": round(seconds, 2)}}
        (out / "demo.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {out / 'demo.json'}")
    return 0
