"""The speculative tree sized from what this machine measures (issue 34 item 1).

A tree pays if the tokens it yields per step outrun greedy decoding:

    tokens/s of a tree  =  accepted length (tokens per step, the bonus one included)
                           / seconds of one speculative step (draft + verify + accept)
    tokens/s of greedy  =  1 / seconds of one greedy step

``choose`` (a pure function) takes both measured, per candidate shape, and picks the fastest
tree, or greedy where no tree beats greedy by ``MARGIN``. What it is fed:

- **step times** (``time_steps``): each candidate's ``eagle3_static.spec_step`` and the
  greedy ``decode_step``, timed on this machine, in this process, on every rank at once (the
  slowest rank's counts; each candidate timed against a greedy step just before it).
  Uncompiled on a CPU (the demo's CPU path compiles with codegen "eager", which runs the
  same ATen ops); on a GPU, the replay of a CUDA graph that captured the step (what
  ``mode="reduce-overhead"`` replays), eager where capture fails; then, on a GPU, the
  ``FINALISTS`` of that screen again with the decoding's own compiled steps, the choice made
  from those times (elsewhere the chosen tree's compiled step is timed once more:
  ``confirm``). The decoding checks itself from step 8,
  every 4 steps, against the greedy baseline and lets greedy take over below 0.97x
  (``specdecode.GUARD_RATIO``), and what it realized is kept for the next run (``learn``).
- **accepted lengths** (``simulate``): the decoder's own walk along a text the target wrote
  greedily, drafting each step's tree with the head and accepting what matches the text,
  which is what greedy verification accepts (``eagle3_static``'s steps, no target call per
  step). Kept with the head (``acceptance.json`` beside its config, per dtype, from held-out
  prompts: ``benchmarks/spec_acceptance.py --write-head``), else measured here on
  ``CALIBRATION`` held-out prompts.

The decision is kept per machine, model, head, TP degree, dtype and torch version in
``<fxcoalesce cache>/spec-tree/`` (the cache the GGUF lives in: ``smollm2.cache_dir``).
With ranks, rank 0 decides and broadcasts it; every rank times the same steps in the same
order (their collectives pair).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from fxcoalesce.models import eagle3_static as es

CANDIDATES = ((1, 1, 2), (1, 2, 3), (1, 3, 4), (1, 4, 5), (2, 3, 8), (4, 4, 16), (8, 6, 32),
              (8, 6, 64), (8, 7, 96))
"""(top_k, depth, total_tokens) timed: chains of 1-4 draft tokens, then wider trees up to
EAGLE-3's default (8, 6, 64), which a GPU verifies at about a greedy step's cost, and one
deeper. (8,7,96) and (8,8,128) cost 5.53 and 5.78 ms against 5.23 for (8,6,64), uncompiled in
CUDA graphs (session 14, an H100), for 3.10 and 3.23 tokens against 3.05 (bf16, 8 prompts);
decoded compiled (session 15, another H100, 32 prompts), (8,7,96) was the fastest tree: +0.10
ms a step for 3.62 tokens against 3.44 (docs/measurements.md). The uncompiled timing
overstates a deeper tree's compiled cost ~3x: on a GPU the finalists are timed compiled."""
FINALISTS = 3
"""On a GPU, the trees of the uncompiled screen's best predicted rates that are timed again
compiled (``decide``'s ``compiled``: the steps the decoding runs, CUDA graphs and all); the
choice is made among them from those times. Each costs a compile (a TreeSpec is a constant
of the graph); the chosen one's is the decoding's."""
MARGIN = 1.05
"""A tree is chosen only if its predicted tokens/s beats greedy's by this factor: the
prediction's acceptance comes from other prompts, and the demo must never fall below
0.97x of greedy."""
CALIBRATION = {"cpu": (2, 48), "cuda": (8, 96)}
"""Held-out prompts and new tokens each, measured when the head keeps no acceptance for the
dtype (a GPU writes them in seconds)."""
STATS_FILE = "acceptance.json"
METHOD = 4
"""How steps are timed and chosen (part of the cache key: a decision measured another way is
not reused). 3: each candidate's median ratio to the greedy step timed just before it; 4: on
a GPU, the ``FINALISTS`` timed again compiled."""
MODES = ("auto", "measure", "spec", "greedy")
"""``--tree``: auto (the cached decision, else measure), measure (anew, rewriting the
cache), spec (the fastest tree even where greedy is faster), greedy; or K,D,N (forced)."""


def key_of(shape: tuple[int, int, int]) -> str:
    return ",".join(map(str, shape))


def parse_tree(text: str) -> str | tuple[int, int, int]:
    """``--tree``'s value: a mode, or (top_k, depth, total_tokens) from 'K,D,N' (checked)."""
    if text in MODES:
        return text
    try:
        k, d, n = (int(x) for x in text.split(","))
        es.TreeSpec(top_k=k, depth=d, total_tokens=n)
    except ValueError as e:
        detail = str(e) if "total_tokens" in str(e) else "expected K,D,N"
        raise ValueError(f"--tree {text}: {detail} (or one of {', '.join(MODES)})") from None
    return k, d, n


@dataclass(slots=True)
class Choice:
    shape: tuple[int, int, int] | None
    """(top_k, depth, total_tokens), or None: decode greedily."""
    reason: str
    """One line: what was measured and why this shape (or greedy)."""
    rates: dict[str, float] = field(default_factory=dict)
    """Predicted tokens/s of each candidate (key 'K,D,N') and of 'greedy'."""

    @property
    def spec(self) -> es.TreeSpec | None:
        if self.shape is None:
            return None
        k, d, n = self.shape
        return es.TreeSpec(top_k=k, depth=d, total_tokens=n)

    def label(self) -> str:
        if self.shape is None:
            return "none (greedy decoding)"
        k, d, n = self.shape
        return f"{n} tokens, depth {d}, top-k {k}"


def choose(greedy_s: float, step_s: dict[str, float], accepted: dict[str, float], *,
           margin: float = MARGIN, force_spec: bool = False) -> Choice:
    """The tree that maximises accepted tokens per second, or greedy when none beats greedy's
    tokens per second by ``margin`` (``force_spec``: the best tree regardless).
    ``greedy_s``: seconds of one greedy step; ``step_s``/``accepted``: per candidate key
    'K,D,N', seconds of one speculative step and tokens it yields on average (>= 1)."""
    rates = {k: accepted[k] / step_s[k] for k in step_s if k in accepted and step_s[k] > 0}
    if not rates or greedy_s <= 0:
        raise ValueError("choose needs a positive greedy step time and at least one candidate "
                         "with both a step time and an accepted length")
    greedy_rate = 1.0 / greedy_s
    best = max(rates, key=lambda k: (rates[k], -step_s[k]))
    k, d, n = (int(x) for x in best.split(","))
    won = rates[best] >= margin * greedy_rate
    why = (f"{accepted[best]:.2f} tokens per {step_s[best] * 1e3:.0f} ms step = "
           f"{rates[best]:.1f} tok/s against greedy's {greedy_s * 1e3:.0f} ms = "
           f"{greedy_rate:.1f} tok/s ({rates[best] / greedy_rate:.2f}x)")
    all_rates = {**{x: round(r, 2) for x, r in rates.items()}, "greedy": round(greedy_rate, 2)}
    if won or force_spec:
        verdict = "fastest" if won else "forced (--tree spec): greedy predicted faster"
        return Choice((k, d, n), f"tree ({k},{d},{n}) {verdict}: {why}", all_rates)
    return Choice(None, f"greedy: no tree beats it by {margin:.2f}x; best tree ({k},{d},{n}): "
                  f"{why}", all_rates)


# --- acceptance: the decoder's walk along a greedy text -------------------------------------

@torch.no_grad()
def simulate(draft, hidden: torch.Tensor, seq: list[int], prompt_len: int,
             spec: es.TreeSpec) -> list[int]:
    """Tokens each step of greedy EAGLE-3 with ``spec`` emits (accepted + 1) along ``seq``
    (prompt then the target's greedy answer), ``hidden`` [len(seq), 3H] the target's captured
    states of ``seq`` (one causal forward): ``speculative_generate_static``'s steps, with the
    verify replaced by comparing the tree with the text. Steps whose path could run past the
    text's end are not taken."""
    dev, M, P = hidden.device, spec.pairs, prompt_len
    ids = torch.tensor(seq, device=dev)
    draft.setup_cache(len(seq) + spec.draft_slots() + 64, hidden.dtype, dev)
    if P > 1:  # the prompt's pairs but the last, as the decoder feeds them after its prefill
        pos = torch.arange(P - 1, device=dev)
        causal = torch.arange(draft.k_cache.shape[1], device=dev)[None, :] <= pos[:, None]
        draft(ids[None, 1:P], draft.fc(hidden[None, : P - 1]), pos, pos, causal[None, None])
    L, n = P, 1
    tokens = torch.zeros(M, dtype=torch.long, device=dev)
    pairs = hidden.new_zeros(M, hidden.shape[-1])
    tokens[0], pairs[0] = ids[P], hidden[P - 1]
    out = []
    while L + M < len(seq):
        tree_tokens, _, depth, mask, _ = es.draft_tree_static(
            draft, tokens, pairs, torch.tensor(n, device=dev), torch.tensor(L, device=dev), spec)
        right = tree_tokens == ids[L + depth]  # the root is ids[L] itself
        accepted = ~(mask & ~right[None, :]).any(1)
        n_acc = int((depth * accepted).max())
        n = n_acc + 1
        tokens = torch.zeros_like(tokens)
        tokens[:n] = ids[L + 1 : L + 1 + n]
        pairs = torch.zeros_like(pairs)
        pairs[:n] = hidden[L : L + n]
        out.append(n)
        L += n
    return out


@torch.no_grad()
def greedy_texts(target, prompts: list[list[int]], tokens: int, eos: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy answer (uncompiled, KV cached)."""
    texts = []
    for p in prompts:
        target.setup_cache(1, -(-(len(p) + tokens + 1) // 64) * 64)
        out = es.greedy_generate_static(target, torch.tensor(p, device=_device(target)), tokens,
                                        stop_tokens=(eos,))
        texts.append(list(p) + out)
    return texts


def _device(module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def accepted_lengths(target, draft, texts: list[tuple[list[int], int]],
                     shapes) -> dict[str, dict]:
    """{key 'K,D,N': {accepted_length, steps}} of each shape, walked along each (sequence,
    prompt length) of ``texts``; the target's states from one causal forward per text."""
    from fxcoalesce.models.eagle3 import prefill

    states = []
    for seq, P in texts:
        target.setup_cache(1, -(-len(seq) // 64) * 64)
        _, hidden = prefill(target, torch.tensor(seq, device=_device(target)))
        states.append(hidden)
    out = {}
    for shape in shapes:
        k, d, n = shape
        spec = es.TreeSpec(top_k=k, depth=d, total_tokens=n)
        steps = [s for (seq, P), h in zip(texts, states) for s in simulate(draft, h, seq, P, spec)]
        out[key_of(shape)] = {"accepted_length": round(sum(steps) / max(len(steps), 1), 4),
                              "steps": len(steps)}
    return out


def head_stats(head: Path, dtype: torch.dtype) -> dict | None:
    """The acceptance kept with the head for ``dtype`` ({key: {accepted_length, steps}},
    with 'prompts' and 'tokens'), or None."""
    path = Path(head) / STATS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(str(dtype).removeprefix("torch."))


# --- step times ------------------------------------------------------------------------------

def _replayable(fn, dev: torch.device, group, capture: bool = True):
    """``fn`` warmed up; on CUDA the replay of a CUDA graph that captured it (every rank
    captures, or none does: then ``fn``; ``capture`` False: ``fn``, e.g. a compiled step
    that replays its own graph)."""
    fn()
    if dev.type != "cuda" or not capture:
        return fn
    graph, ok = torch.cuda.CUDAGraph(), True
    try:
        torch.cuda.synchronize(dev)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except RuntimeError:
        torch.cuda.synchronize(dev)
        ok = False
    if group is not None:
        flag = torch.tensor([int(ok)], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag)
    if ok:
        def run(graph=graph, fn=fn):
            """The replay, holding ``fn``: the graph reads the tensors ``fn`` holds (a step's
            state and pairs) at fixed addresses but keeps none of them alive. Without this,
            freed, their memory went to later tensors and a replay read garbage:
            ``index_copy_(): index out of bounds`` on an H100 in session 7, gone with this
            in session 8 (benchmarks/gpu_time_steps.py)."""
            graph.replay()
    else:
        run = fn
    run()
    return run


def _seconds(run, dev: torch.device, group) -> float:
    """One timed call of ``run``: CUDA events on a GPU, else wall time after a barrier."""
    if dev.type == "cuda":
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


@torch.no_grad()
def time_steps(target, draft, prompt: list[int], shapes, *, group=None, reps: int = 4,
               greedy_fn=es.decode_step, step_fn=es.spec_step, capture: bool = True,
               per_round: list | None = None) -> tuple[float, dict[str, float]]:
    """(seconds of a greedy step, {key: seconds of a speculative step}) after ``prompt``,
    with the caches as they are set up (the step's masks span them: set them up as the
    decoding will). Each step is warmed up, then timed ``reps`` times in rounds, each
    candidate right after a greedy step: a candidate costs the median of its ratios to the
    greedy step just before it times the median greedy step, so a change of the machine's
    load between calls cancels (on 2 shared cores, under load 4-9, plain medians of 3 rounds
    put a 16-token step at 0.36 s and an 8-token one at 1.69 s, and the fastest of 4 rounds a
    3-token step at 199 ms against greedy's 180). The slowest rank's figures; every rank runs
    the same calls in the same order. ``per_round``: a list that receives each round's
    (seconds of its last greedy step, [seconds of each candidate's step]), this rank's."""
    import statistics

    from fxcoalesce.models.eagle3 import prefill

    dev = _device(target)
    p = torch.tensor(prompt, device=dev)
    logits, hidden = prefill(target, p)
    P = len(prompt)
    root = logits[-1].argmax()
    greedy_state = torch.stack([root, torch.tensor(P, device=dev)])
    runs = [_replayable(lambda: greedy_fn(target, greedy_state), dev, group, capture)]
    specs = [s if isinstance(s, es.TreeSpec) else es.TreeSpec(top_k=s[0], depth=s[1],
                                                                total_tokens=s[2])
             for s in shapes]
    for spec in specs:  # a compiled step is called with its own TreeSpec: no recompile
        state = torch.zeros(spec.pairs + 2, dtype=torch.long, device=dev)
        state[0], state[1], state[2] = P, 1, root
        pairs = hidden.new_zeros(spec.pairs, hidden.shape[-1])
        pairs[0] = hidden[-1]
        runs.append(_replayable(lambda state=state, pairs=pairs, spec=spec:
                                step_fn(target, draft, state, pairs, spec), dev, group, capture))
    greedy, ratios = [], [[] for _ in shapes]
    for _ in range(reps):
        steps = []
        for i, run in enumerate(runs[1:]):
            greedy.append(_seconds(runs[0], dev, group))
            steps.append(_seconds(run, dev, group))
            ratios[i].append(steps[-1] / greedy[-1])
        if per_round is not None:
            per_round.append((greedy[-1], steps))
    g = statistics.median(greedy)
    t = torch.tensor([g] + [g * statistics.median(r) for r in ratios], dtype=torch.float64,
                     device=dev)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0]), {key_of((s.top_k, s.depth, s.total_tokens)): float(x)
                         for s, x in zip(specs, t[1:].tolist())}


# --- the cache and the agreed decision --------------------------------------------------------

def machine_key(dev: torch.device, world: int, dtype: torch.dtype, head: Path,
                extra: str = "") -> dict:
    """What a decision holds for: this machine and device, the TP degree, the threads, the
    dtype, torch, the head's files (config and stored acceptance), the settings."""
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    digest = hashlib.sha256()
    for f in ("config.json", STATS_FILE):
        if (Path(head) / f).is_file():
            digest.update((Path(head) / f).read_bytes())
    return {"host": platform.node(), "device": name, "tp": world,
            "threads": torch.get_num_threads() if dev.type == "cpu" else 0,
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "head": digest.hexdigest()[:16], "settings": extra, "candidates":
            [key_of(c) for c in CANDIDATES], "method": METHOD}


def cache_path(key: dict) -> Path:
    from fxcoalesce.apps.spec.smollm2 import cache_dir

    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "spec-tree" / f"{key['tp']}x-{name}.json"


def read_cached(key: dict) -> dict | None:
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if data.get("key") == key else None


def write_cached(key: dict, record: dict) -> Path:
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"key": key, **record}, indent=1) + "\n")
    tmp.replace(path)
    return path


def _broadcast(values: list[int], dev: torch.device, group) -> list[int]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.long, device=dev)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0,
                   group=group)
    return t.tolist()


@torch.no_grad()
def decide(mode, *, target, draft, tok, head: Path, prompt: list[int], group, dev: torch.device,
           dtype: torch.dtype, settings: str = "", say=None, setup=None,
           compiled=None) -> tuple[Choice, dict]:
    """The tree every rank decodes with (rank 0's decision, broadcast), and the record behind
    it (rank 0: times, accepted lengths, rates, where they came from, the cache file).
    ``mode``: a ``MODES`` entry or a forced (k, d, n). The caches must be set up for the
    largest candidate (``room_for_candidates``); ``setup()`` sets them up again after a
    calibration has used them, before the timing. ``compiled``: (greedy step, speculative
    step) as the decoding runs them: the ``FINALISTS`` are timed again with them, and the
    choice is made from those times (``record["screen"]`` keeps the uncompiled ones)."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    if mode == "greedy" or isinstance(mode, tuple):
        shape = None if mode == "greedy" else tuple(mode)
        return Choice(shape, f"forced by --tree {mode if shape is None else key_of(shape)}"), {
            "source": "forced"}
    key = machine_key(dev, world, dtype, head,
                      settings + (" compiled finalists" if compiled is not None else ""))
    cached = read_cached(key) if rank == 0 and mode in ("auto", "spec") else None
    stats = head_stats(head, dtype) if rank == 0 else None
    have = stats is not None and all(key_of(c) in stats for c in CANDIDATES)
    measure, calibrate = _broadcast([int(cached is None), int(not have)], dev, group)
    if measure:
        t0 = time.perf_counter()
        if calibrate:  # every rank: the target's forward needs all of them
            from fxcoalesce.apps.spec.prompts import held_out_prompts

            n, new = CALIBRATION.get(dev.type, CALIBRATION["cpu"])
            if say:
                say(f"  measuring the head's acceptance on {n} held-out prompts ({new} tokens "
                    f"each; it keeps none for {str(dtype).removeprefix('torch.')})")
            prompts = [tok.encode_chat(t) for t in held_out_prompts(n)]
            texts = greedy_texts(target, prompts, new, tok.eos_id)
            stats = accepted_lengths(target, draft, [(s, len(p)) for s, p in zip(texts, prompts)],
                                     CANDIDATES)
            stats |= {"prompts": n, "tokens": new}
            if setup is not None:
                setup()
        if say:
            say(f"  timing a greedy step and {len(CANDIDATES)} tree shapes on "
                f"{world} rank{'s' * (world > 1)} ...")
        greedy_s, step_s = time_steps(target, draft, prompt, CANDIDATES, group=group)
        record = {"source": "measured", "greedy_step_s": round(greedy_s, 5),
                  "step_s": {k: round(v, 5) for k, v in step_s.items()}, "timed": "uncompiled"}
        if compiled is not None:
            accepted = {k: stats[k]["accepted_length"] for k in step_s} if rank == 0 else {}
            record = _compiled_finalists(record, accepted, compiled, target=target,
                                         draft=draft, prompt=prompt, group=group, dev=dev,
                                         say=say)
            greedy_s, step_s = record["greedy_step_s"], record["step_s"]
        record["measure_s"] = round(time.perf_counter() - t0, 1)
        if rank == 0:
            record["accepted"] = {k: stats[k]["accepted_length"] for k in step_s}
            record["acceptance_from"] = (f"{STATS_FILE} kept with the head" if not calibrate
                                         else "measured here") + (
                f", {stats.get('prompts')} held-out prompts x {stats.get('tokens')} tokens")
            best = choose(greedy_s, step_s, record["accepted"])
            record |= {"choice": key_of(best.shape) if best.shape else "greedy",
                       "reason": best.reason, "rates": best.rates}
            record["cache"] = str(write_cached(key, record))
            record["key"] = key
    else:
        record = dict(cached or {}, source="cached")
        if cached is not None:
            record["cache"], record["key"] = str(cache_path(key)), key
    if rank == 0:
        forced = mode == "spec"
        best = choose(record["greedy_step_s"], corrected(record), record["accepted"],
                      force_spec=forced)
        shape = best.shape or (0, 0, 0)
    else:
        shape = (0, 0, 0)
    shape = tuple(_broadcast(list(shape), dev, group))
    if rank != 0:
        return Choice(None if shape == (0, 0, 0) else shape, "rank 0's decision"), record
    return best, record


def _compiled_finalists(record: dict, accepted: dict, compiled, *, target, draft, prompt,
                        group, dev, say) -> dict:
    """``record`` with the step times of the uncompiled screen's ``FINALISTS`` (rank 0's
    pick by predicted rate, broadcast) timed again with the compiled steps; the screen's
    times kept under "screen"."""
    if accepted:
        rates = {k: accepted[k] / t for k, t in record["step_s"].items() if t > 0}
        best = sorted(rates, key=rates.get, reverse=True)[:FINALISTS]
        picks = [[key_of(c) for c in CANDIDATES].index(k) for k in best]
    else:
        picks = []
    picks = [i for i in _broadcast(picks + [-1] * (FINALISTS - len(picks)), dev, group)
             if i >= 0]
    shapes = [CANDIDATES[i] for i in picks]
    if say:
        say(f"  timing the {len(shapes)} fastest predicted trees compiled, as the decoding "
            f"runs them ({', '.join(map(key_of, shapes))}; each compiles first)")
    greedy_fn, step_fn = compiled
    greedy_s, step_s = time_steps(target, draft, prompt, shapes, group=group,
                                  greedy_fn=greedy_fn, step_fn=step_fn, capture=False)
    return {**record, "screen": {"greedy_step_s": record["greedy_step_s"],
                                 "step_s": record["step_s"]},
            "greedy_step_s": round(greedy_s, 5),
            "step_s": {k: round(v, 5) for k, v in step_s.items()}, "timed": "compiled"}


def corrected(record: dict) -> dict[str, float]:
    """The candidates' step times scaled by what compiling cost (``confirm``'s factor: the
    compiled step against the greedy step the decoding compares with, over the uncompiled
    ratio; 1 until a chosen tree was confirmed)."""
    f = record.get("compiled_factor", 1.0)
    return {k: v * f for k, v in record["step_s"].items()}


@torch.no_grad()
def confirm(choice: Choice, record: dict, *, target, draft, prompt: list[int], group,
            dev: torch.device, greedy_fn, step_fn, capture: bool, spec=None) -> Choice:
    """The chosen tree's compiled step (``step_fn``) timed against the greedy step the
    decoding is compared with (``greedy_fn``), after its compile: if it no longer beats
    greedy, greedy (rank 0's answer, broadcast). The factor it found is kept in the cached
    decision, so the next run chooses with it."""
    rank = dist.get_rank(group) if group is not None else 0
    # rank 0's record says whether there is a prediction to confirm (the others' records of
    # a cached decision are empty): one answer for all, or the ranks' timings would not pair
    go = int(rank == 0 and choice.shape is not None and record.get("source") != "forced"
             and "step_s" in record and record.get("timed") != "compiled")
    if not _broadcast([go], dev, group)[0]:
        return choice
    key = key_of(choice.shape)
    greedy_s, step_s = time_steps(target, draft, prompt, [spec or choice.shape], group=group,
                                  greedy_fn=greedy_fn, step_fn=step_fn, capture=capture)
    keep = 1
    if rank == 0:
        factor = (step_s[key] / greedy_s) / (record["step_s"][key] / record["greedy_step_s"])
        record["compiled_factor"] = round(factor * record.get("compiled_factor", 1.0), 4)
        record["confirm"] = {"greedy_step_s": round(greedy_s, 5),
                             "step_s": round(step_s[key], 5)}
        ratio = record["accepted"][key] / step_s[key] * greedy_s
        keep = int(ratio >= 1.0)
        if record.get("cache"):
            write_cached({k: v for k, v in machine_key_of(record).items()},
                         {k: v for k, v in record.items() if k != "key"})
    keep = _broadcast([keep], dev, group)[0]
    if keep:
        return choice
    if rank != 0:
        return Choice(None, "rank 0's decision")
    return Choice(None, f"greedy: the chosen tree {choice.shape}, compiled, measured "
                  f"{step_s[key] * 1e3:.0f} ms a step against greedy's {greedy_s * 1e3:.0f} ms: "
                  f"{ratio:.2f}x", choice.rates)


def learn(record: dict, shape: tuple[int, int, int], realized: float) -> dict | None:
    """After a decoding with the chosen tree: its tokens/s over greedy's as realized against
    the predicted ratio; the cached decision's factor is scaled by their quotient, so the next
    run on this machine chooses with what the decoding really did (a tree that decoded below
    greedy is then not chosen again unless a re-measure says so). -> what was learned."""
    if "step_s" not in record or not record.get("cache") or record.get("source") == "forced":
        return None
    key = key_of(shape)
    step = corrected(record)[key]
    predicted = record["accepted"][key] / step * record["greedy_step_s"]
    record["compiled_factor"] = round(record.get("compiled_factor", 1.0)
                                      * predicted / max(realized, 1e-6), 4)
    record["realized"] = {"tree": key, "predicted": round(predicted, 3),
                          "realized": round(realized, 3)}
    write_cached(record["key"], {k: v for k, v in record.items() if k != "key"})
    return record["realized"] | {"compiled_factor": record["compiled_factor"]}


def machine_key_of(record: dict) -> dict:
    return record["key"]


def room_for_candidates(mode: str | tuple[int, int, int] = "auto") -> tuple[int, int, int]:
    """(target slots one step needs, draft slots past the committed length, tokens one step
    emits) of the largest candidate, or of the tree ``mode`` forces where larger: the caches
    the timing and every chosen tree fit (a forced (8, 7, 96) once overran the draft cache
    sized for (8, 6, 64))."""
    shapes = list(CANDIDATES) + ([tuple(mode)] if isinstance(mode, (tuple, list)) else [])
    specs = [es.TreeSpec(top_k=k, depth=d, total_tokens=n) for k, d, n in shapes]
    return (max(s.total_tokens for s in specs), max(s.draft_slots() for s in specs),
            max(s.pairs for s in specs))
