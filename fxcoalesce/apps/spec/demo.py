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
from dataclasses import dataclass, replace
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


@dataclass(slots=True)
class SmolRun:
    """One speculative decoding of a prompt, on every rank, and what to print of it."""

    summary: dict
    """``specdecode.summarize``: accepted length, tokens/s, all_reduces, verdicts, pass ms."""
    result: dict
    """Rank 0's result for the prompt (its tokens, whether they equal greedy's)."""
    text: str
    stopped: bool
    """The answer ended at EOS (else at the token limit)."""
    options: SpecOptions


def decode_smollm2(*, prompt: str, tokens: int, tp: int, device: str, backend: str | None,
                   codegen: str | None, draft: str | None, quiet: bool = False,
                   warmup_tokens: int = 16, greedy_compiled: bool = True,
                   tree=None) -> SmolRun:
    """Answer ``prompt`` with SmolLM2-135M and the trained EAGLE-3 head (``draft``, else the
    repository's), speculatively and greedily, on ``tp`` ranks (spawned when more than 1);
    the weights are fetched once and checked here, before any rank starts. ``quiet``: no
    progress on stderr; ``warmup_tokens``: the untimed first decoding, which compiles;
    ``greedy_compiled`` False: the greedy baseline runs uncompiled (one compile fewer)."""
    job = prepare_smollm2(prompt=prompt, tokens=tokens, device=device, codegen=codegen,
                          draft=draft, quiet=quiet, warmup_tokens=warmup_tokens,
                          greedy_compiled=greedy_compiled, tree=tree)
    be = backend or default_backend(device, tp)
    if not quiet:
        print(job.describe(tp) + (f"; starting {tp} {be} ranks ..." if tp > 1 else ""),
              file=sys.stderr, flush=True)
    if tp == 1:
        ranks = [spec_worker(0, 1, job.options)]
    else:
        ranks = spawn(spec_worker, tp, (job.options,), backend=be)
    return job.finish(ranks)


@dataclass(slots=True)
class SmolJob:
    """A checked SmolLM2 decoding, before any rank starts: the ranks' options and the
    tokenizer that reads their answer."""

    options: SpecOptions
    tokenizer: smollm2.ChatTokenizer
    head: Path

    def describe(self, tp: int) -> str:
        opt = self.options
        if opt.tree is None:
            tree = f"tree of {opt.total_tokens} (depth {opt.depth}, top-k {opt.top_k})"
        elif isinstance(opt.tree, tuple):
            k, d, n = opt.tree
            tree = f"tree of {n} (depth {d}, top-k {k}; forced)"
        else:
            tree = {"greedy": "greedy (forced)", "spec": "the fastest tree measured here",
                    }.get(opt.tree, "the tree sized from this machine's measured step times")
        return (f"speculative decoding: {smollm2.NAME}, TP={tp}, head {self.head}, up to "
                f"{opt.tokens} new tokens, {tree}, codegen {opt.codegen}"
                f"{', CUDA graphs' if opt.mode else ''}")

    def finish(self, ranks: list[dict]) -> SmolRun:
        """The run from every rank's ``spec_worker`` record."""
        tok, r = self.tokenizer, ranks[0]["results"][0]
        return SmolRun(summarize(ranks[0], ranks), r, tok.decode(r["tokens"]).strip(),
                       r["tokens"][-1] == tok.eos_id, self.options)


def prepare_smollm2(*, prompt: str, tokens: int, device: str, codegen: str | None,
                    draft: str | None, quiet: bool = False, warmup_tokens: int = 16,
                    greedy_compiled: bool = True, tree=None) -> SmolJob:
    """Check the head and the prompt, fetch and check the weights (once), tokenize: what
    ``spec_worker`` needs, or the ValueError / WeightsError that says what is wrong.
    ``tree``: ``SpecOptions.tree`` ('auto', 'measure', 'spec', 'greedy', (k, d, n), or
    None for the default tree)."""
    from fxcoalesce.models import llama

    target_args = llama.CONFIGS[smollm2.NAME]
    head = head_path(draft)
    check_compatible(read_config(head), head, smollm2.NAME, target_args)
    gguf = smollm2.gguf_path()
    tok = smollm2.ChatTokenizer(smollm2.read_gguf(gguf))
    ids = tok.encode_chat(prompt)
    cuda = device == "cuda"
    opt = SpecOptions(gguf=str(gguf), draft=str(head), prompts=(tuple(ids),), tokens=tokens,
                      device=device, codegen=codegen or ("inductor" if cuda else "eager"),
                      mode="reduce-overhead" if cuda else None, warmup_tokens=warmup_tokens,
                      greedy_compiled=greedy_compiled, quiet=quiet, tree=tree,
                      prefill_compiled=cuda)
    if isinstance(tree, tuple):
        k, d, n = tree
        opt = replace(opt, top_k=k, depth=d, total_tokens=n)
    need = len(ids) + tokens + opt.total_tokens
    if need > target_args.max_seq_len:
        raise ValueError(f"the prompt is {len(ids)} tokens (chat template included); with "
                         f"--tokens {tokens} and a tree of {opt.total_tokens} it needs {need} "
                         f"positions, past {smollm2.NAME}'s context of {target_args.max_seq_len}")
    return SmolJob(opt, tok, head)


def smollm2_lines(run: SmolRun, tp: int) -> list[str]:
    """The figures of a run, one per line: all_reduces and the report's verdict, accepted
    length, tokens/s against greedy, whether the tokens are greedy's, the pass's own time."""
    s, r = run.summary, run.result
    choice = s.get("tree_choice") or {}
    greedy = bool(choice.get("greedy_chosen"))
    lines = []
    if choice:
        lines += [f"tree                             : {choice['label']} "
                  f"({choice.get('source', 'measured')})",
                  f"  because                        : {choice['reason']}"]
    step = "decode" if greedy and "decode" in s["all_reduce_per_call"] else "spec"
    a, verdict = s["all_reduce_per_call"].get(step), s["verdict"].get(step)
    if a and tp > 1:
        lines.append(f"all_reduce per {'decode' if step == 'decode' else 'speculative'} step"
                     f"{'       ' if step == 'decode' else '  '}: {a['before']} -> {a['after']} "
                     f"(lower bound {a['lower_bound']}); the report: {verdict}")
    lines.append(f"new tokens                       : {r['spec_tokens']}"
                 f"{' (stopped at EOS)' if run.stopped else ''}")
    if greedy:
        lines += [
            f"tokens per second                : {s['tokens_per_s']['target_greedy']:.1f} "
            "greedy, compiled through fxcoalesce (chosen: no tree is faster here; prefill "
            "included, after compilation)",
            "tokens equal target greedy       : True (greedy decoding itself)"]
    else:
        lines += [
            f"mean accepted length             : {s['mean_accepted']:.2f} tokens per verify",
            f"tokens per second                : {s['tokens_per_s']['speculative']:.1f} "
            f"speculative, {s['tokens_per_s']['target_greedy']:.1f} target-only greedy"
            f"{'' if run.options.greedy_compiled else ', uncompiled'} "
            f"({s['speedup_vs_target_greedy']:.2f}x; prefill included, after compilation)"
            + (f"; greedy took over after {r['greedy_from']} steps, the speculative tokens/s "
               "so far below greedy's" if r.get("greedy_from") else ""),
            f"tokens equal target greedy       : {r['same_tokens']}"]
    lines.append(f"ranks agree                      : {s['ranks_agree']}")
    if cost := s["pass_ms"].get(step):
        lines.append(f"fxcoalesce inside the compile    : {pass_cost_text(cost)} for the "
                     f"{'greedy decode' if step == 'decode' else 'speculative'} step's graph")
    return lines


def pass_cost_text(cost: dict) -> str:
    """'41.5 ms (pipeline 30.4 ms, agreeing 11.1 ms)' from ``Report.pass_cost_ms()``."""
    agreeing = cost["ladder"] + cost["exchange"]
    return (f"{cost['total']:.1f} ms (pipeline {cost['pipeline']:.1f} ms"
            + (f", agreeing {agreeing:.1f} ms" if agreeing else "") + ")")


def run_smollm2_demo(args) -> int:
    t0 = time.perf_counter()
    run = decode_smollm2(prompt=args.prompt, tokens=args.tokens or DEFAULT_TOKENS, tp=args.tp,
                         device=args.device, backend=args.backend, codegen=args.codegen,
                         draft=args.draft, quiet=getattr(args, "quiet", False),
                         tree=tree_arg(args))
    print(f"\n{args.prompt}\n\n{run.text}\n")
    print(f"{smollm2.NAME}, TP={args.tp} ({run.summary['backend']}), {run.summary['device']}")
    for line in smollm2_lines(run, args.tp):
        print(f"  {line}")
    print(f"  wall time                        : {time.perf_counter() - t0:.0f} s")
    if getattr(args, "out", None):
        print(f"wrote {write_demo_json(run, args)}")
    return 0


def tree_arg(args):
    """``--tree`` parsed (``treechoice.parse_tree``), None when not given."""
    from fxcoalesce.apps.spec.treechoice import parse_tree

    given = getattr(args, "tree", None)
    return None if given is None else parse_tree(given)


def write_demo_json(run: SmolRun, args) -> Path:
    """``DIR/demo.json`` with what the demo prints. No ``verify_ms``: this demo sets
    speculative decoding against greedy decoding, not the verify step with and without the
    pass (a sequential model is at its bound: nothing to rewrite)."""
    import torch

    s, r, opt = run.summary, run.result, run.options
    spec = s["all_reduce_per_call"].get("spec") or {}
    data = {
        "model": smollm2.NAME, "tp": args.tp, "backend": s["backend"], "device": s["device"],
        "codegen": opt.codegen, "mode": opt.mode, "prompt": args.prompt, "head": opt.draft,
        "tree": s.get("tree"), "tree_choice": s.get("tree_choice"),
        "all_reduce": {k: spec.get(k, 0) for k in ("before", "after", "lower_bound")},
        "verdict": s["verdict"].get("spec", ""), "pass_ms": s["pass_ms"].get("spec"),
        "new_tokens": r["spec_tokens"], "stopped_at_eos": run.stopped,
        "mean_accepted": s["mean_accepted"], "tokens_per_s": s["tokens_per_s"],
        "speedup_vs_target_greedy": s["speedup_vs_target_greedy"],
        "tokens_equal_target_greedy": r["same_tokens"], "ranks_agree": s["ranks_agree"],
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": getattr(args, "command_line", ""), "text": run.text,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(data, indent=2) + "\n")
    return out / "demo.json"
