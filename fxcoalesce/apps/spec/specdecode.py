"""SmolLM2-135M with a trained EAGLE-3 head: speculative decoding against the target's own
greedy decoding, both compiled the same way, on one rank or tensor-parallel ranks.

Each rank builds the target from the GGUF and the draft head (the draft's embedding is the
target's full one, taken before ``apply_tp`` shards it), allocates both KV caches once and
compiles two steps through the fxcoalesce backend with the same settings:

    decode  = compile(eagle3_static.decode_step)   target-only greedy, one token per call
    spec    = compile(eagle3_static.spec_step)     draft tree + verify + accept + KV commit

and, with ``SpecOptions.prefill_compiled`` (on GPUs), each decoding's prefill
(``prefill_static``, ``spec_prefill_static``: the prompt padded to a multiple of 64).

With ``SpecOptions.tree`` set, the tree is first sized from measurement (``treechoice``:
every rank times the candidate steps, rank 0 decides and broadcasts); where greedy is chosen
only the compiled greedy step runs, and a chosen tree hands over to greedy when it falls
below greedy's pace (``GUARD_RATIO``). ``mode="reduce-overhead"`` makes each a CUDA graph on
GPUs. A warm-up prompt compiles and records them; every prompt is then decoded both ways,
timed end to end (prefill included, and apart), and the two token sequences are compared.
``greedy_compiled=False`` (``fxcoalesce demo --tree`` on a CPU) runs the greedy step
uncompiled: one compile fewer, greedy's tokens the plain model's.
Rank 0 says on stderr what it loads, compiles and decodes (``apps.progress``).

``race_worker`` is the CPU demo's short look instead (nothing compiled): the answer decoded
greedily, the smallest tree's accepted length along it, and a greedy step timed against that
tree's step, round by round.

Before torch 2.14 the backend leaves Inductor's own comm-reordering passes off: there
``sink_waits`` moved the wait of the speculative step's last all_reduce past a fused kernel
that reads its result (wrong tokens at TP 2; benchmarks/NOTES.md). A sequential model has
nothing to overlap anyway.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fxcoalesce.compiler import backend
from fxcoalesce.config import Config

from fxcoalesce.apps.spec import smollm2, treechoice
from fxcoalesce.apps.spec.draft_head import load_head


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecOptions:
    gguf: str
    """The checked GGUF (the parent resolves it, so ranks never fetch)."""
    draft: str
    """Draft head directory (fxcoalesce train-draft --out)."""
    prompts: tuple[tuple[int, ...], ...]
    """Prompts as token ids (chat template applied)."""
    tokens: int = 256
    """Most new tokens per prompt (EOS stops earlier)."""
    device: str = "cpu"
    top_k: int = 8
    depth: int = 6
    total_tokens: int = 64
    codegen: str = "inductor"
    """fxcoalesce Config.codegen for both steps ("eager" compiles in seconds on CPU)."""
    mode: str | None = None
    """torch.compile mode for both steps ("reduce-overhead": CUDA graphs)."""
    warmup_tokens: int = 48
    """New tokens of the untimed warm-up run on the first prompt (compiles, records graphs)."""
    progress: str | None = None
    """Rank 0 rewrites this JSON file with the summary so far after every prompt."""
    greedy_compiled: bool = True
    """Compile the target-only greedy step too (the baseline); False runs it eagerly: one
    compile fewer (``fxcoalesce demo --tree`` on a CPU: the eager step is as fast, within noise),
    and greedy's tokens are then those of the uncompiled model."""
    quiet: bool = False
    """Rank 0 says nothing on stderr (else: what it loads, compiles and decodes, time so far,
    a line at least every ``progress.HEARTBEAT_S`` seconds)."""
    tree: str | tuple[int, int, int] | None = None
    """None: the tree of ``top_k``, ``depth``, ``total_tokens``. Else sized from measurement
    (``treechoice``): "auto" (the decision cached for this machine, model, head and TP degree,
    else measured), "measure" (anew), "spec" (the fastest tree even where greedy is faster),
    "greedy", or a forced (top_k, depth, total_tokens). Where greedy is chosen, the greedy
    step is compiled through fxcoalesce and decodes alone: there is no speculative run."""
    prefill_compiled: bool = False
    """Prefill in a compiled graph too, the prompt padded to a multiple of 64
    (``eagle3_static.prefill_static``; the speculative one fills the draft's cache in the same
    graph): False prefills eagerly in the prompt's own shape. Both decodings use the same. On
    an H100 the eager prefill took 24-50 ms (~1,500 kernels launched one by one), 70-125 ms at
    a prompt length the process had not seen (the libraries' set-up per shape): a fifth of a
    256-token speculative decoding; compiled, 3.0-3.8 ms (benchmarks/NOTES.md, session 12)."""
    launch_ahead: bool | None = None
    """Both decodings launch each step before the host reads the last (``LAUNCH_AHEAD``);
    None: on the devices ``LAUNCH_AHEAD`` names."""
    dtype: str | None = None
    """"bfloat16" or "float32"; None: bfloat16 on a GPU, float32 on a CPU."""


GUARD_FIRST, GUARD_EVERY, GUARD_RATIO = 8, 4, 0.97
"""With a tree chosen by measurement (``tree`` auto or measure), at step 8 and every 4 steps
after it the speculative decoding compares its tokens/s so far with the greedy baseline's on
the same prompt; below 0.97x, greedy decoding takes over from the same cache (the same
tokens): a machine whose load changed since the tree was timed does not keep a losing tree.
Both rates leave the prefill out (each clock starts after the first step): charged to the
first 8 steps' ~28 tokens instead of greedy's 256, one prefill made every tree lose on an
H100. Every 4, not 8: on the CPU demo a prompt accepting 1.56 where 2.24 was predicted ran 16
steps at ~0.9x before greedy took over, 0.96x overall (2026-12-06); a check is one broadcast
of a flag. Not before step 8: an answer's first steps accept less (held-out prompts, the
(8, 6, 64) tree: 2.1 and 2.4 tokens at steps 1 and 2, 3.1 from step 3 on), and 3 steps are
a small sample (a step accepts 1-7 tokens, sd 1.7): checked from step 4, 3 of 32 prompts on
an H100 gave up at step 4 (each at ~1.0x of greedy, where the others ran ~2x; the float32
replay on a CPU gives up on the same three, and from step 8 on none; session 12)."""


LAUNCH_AHEAD = ("cuda",)
"""Devices where each decoding step, greedy and speculative alike, is launched before the host
reads the one before it (``eagle3_static._Steps``): on an H100 the host's work between two
CUDA-graph replays (the read, the stop test, the next replay's launch) took 0.4-1 ms a step
where the GPU's took 1.3 ms (greedy) and 1.9 ms (the 64-token tree), one after the other
(benchmarks/NOTES.md, session 14). A CPU computes while the host waits: nothing to hide."""


def ahead(opt: SpecOptions) -> bool:
    return opt.device in LAUNCH_AHEAD if opt.launch_ahead is None else opt.launch_ahead


def cache_len(opt: SpecOptions) -> int:
    """Target KV cache slots: the longest prompt, the new tokens, one step's tree (the largest
    candidate's when the tree is chosen by measurement) and the tokens of the step launched
    past the end on CUDA (``LAUNCH_AHEAD``), rounded up to 64 (aligned attention masks)."""
    if opt.tree is not None:
        tree, _, past = treechoice.room_for_candidates(opt.tree)
    else:
        tree, past = opt.total_tokens, opt.depth + 1
    need = (max(map(len, opt.prompts)) + max(opt.tokens, opt.warmup_tokens) + tree
            + (past if ahead(opt) else 0))
    return -(-need // 64) * 64


def draft_room(opt: SpecOptions) -> int:
    """Draft KV cache slots past the target's."""
    if opt.tree is not None:
        return treechoice.room_for_candidates(opt.tree)[1]
    return es_spec(opt).draft_slots()


def es_spec(opt: SpecOptions):
    from fxcoalesce.models import eagle3_static as es

    return es.TreeSpec(top_k=opt.top_k, depth=opt.depth, total_tokens=opt.total_tokens)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def step_rate_guard(rate: float, group, dev: torch.device, *, first: int = GUARD_FIRST,
                    clock=time.perf_counter):
    """``speculative_generate_static``'s ``give_up``: at step ``first`` and every
    ``GUARD_EVERY`` after it, is the speculative decoding's pace since its first step, the
    tokens a step over the *median* step's seconds, below ``GUARD_RATIO`` x ``rate``
    (greedy's tokens/s over its steps on the same prompt, measured just before)? The median,
    not the mean: one stalled step early on (20+ ms on an H100, 2026-12-06) made a 2x tree
    look slower than greedy after 4 steps and gave it up; a slowdown that lasts moves the
    median too. Rank 0's answer, broadcast over ``group`` (None: one rank). ``clock``: seconds
    (a replay passes its own: benchmarks/guard_replay.py)."""
    seen: list[tuple[float, int]] = []  # (time, tokens) after each step from the first

    def give_up(steps: int, tokens: int) -> bool:
        seen.append((clock(), tokens))
        if steps < first or steps % GUARD_EVERY or len(seen) < 2:
            return False
        took = sorted(b[0] - a[0] for a, b in zip(seen, seen[1:]))
        per_step = (tokens - seen[0][1]) / (len(seen) - 1)
        slow = per_step / max(took[len(took) // 2], 1e-9) < GUARD_RATIO * rate
        if group is not None:
            flag = torch.tensor([int(slow)], device=dev)
            dist.broadcast(flag, 0)
            slow = bool(flag)
        return slow
    return give_up


@dataclass(slots=True)
class Loaded:
    """One rank's target (sharded) and draft head, their caches set up by ``setup_caches``."""

    dev: torch.device
    group: object
    dtype: torch.dtype
    say: object
    """Progress on stderr (rank 0 unless quiet), else None."""
    on: str
    """'on 2 ranks', for progress lines."""
    target: torch.nn.Module
    draft: torch.nn.Module
    tok: smollm2.ChatTokenizer
    head_config: dict
    cache_len: int

    def setup_caches(self, opt: SpecOptions) -> None:
        self.target.setup_cache(1, self.cache_len)
        self.draft.setup_cache(self.cache_len + draft_room(opt))


def load(rank: int, world: int, opt: SpecOptions) -> Loaded:
    """This rank's device and threads, the target and head loaded, sharded and cached."""
    from fxcoalesce.apps.progress import Phase, stderr_say
    from fxcoalesce.models import llama

    cuda = opt.device == "cuda"
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = dist.group.WORLD if world > 1 else None
    dtype = getattr(torch, opt.dtype) if opt.dtype else (torch.bfloat16 if cuda else
                                                            torch.float32)
    say = stderr_say if rank == 0 and not opt.quiet else None
    on = f"on {world} rank{'s' * (world > 1)}"
    with Phase(say, f"loading {smollm2.NAME} and its draft head {on}"):
        target, tok = smollm2.load_target(device=dev, dtype=dtype, path=opt.gguf)
        draft, head_config = load_head(opt.draft, target_name=smollm2.NAME,
                                       target_args=target.args,
                                       embed_weight=target.embed.weight.detach().clone(),
                                       device=dev, dtype=dtype)
        llama.apply_tp(target, group)
    m = Loaded(dev, group, dtype, say, on, target, draft, tok, head_config, cache_len(opt))
    m.setup_caches(opt)
    return m


RACE_TREE = (1, 1, 2)
"""The smallest tree (top_k, depth, total_tokens): one draft token a step, two verified."""
RACE_ROUNDS = 10
"""Rounds of the CPU's step race: all ten won gives sign test p = 0.001, nine 0.011."""


@torch.no_grad()
def race_worker(rank: int, world: int, opt: SpecOptions) -> dict:
    """One rank of the CPU's short look at speculative decoding: the answer to the first
    prompt decoded greedily; the smallest tree's (``RACE_TREE``) tokens a step along that
    answer (``treechoice.accepted_lengths``: the decoder's own walk, no target call a step);
    then ``RACE_ROUNDS`` rounds of a greedy step against that tree's step on the state after
    the prompt (``treechoice.time_steps``). Nothing compiles: on a CPU fxcoalesce compiles
    these steps with the eager codegen, the same ATen ops, and compiling them took 14 and 20 s
    of CPU time a rank at TP 2 (2026-12-07, torch 2.13), where the 64-token answer took 7."""
    from fxcoalesce.apps.progress import Phase
    from fxcoalesce.models import eagle3_static as es

    m = load(rank, world, opt)
    prompt = list(opt.prompts[0])
    with Phase(m.say, f"answering greedily, uncompiled, {m.on}", total=opt.tokens,
               unit="tokens", done="") as phase:
        def step(*args):
            phase.advance()
            return es.decode_step(*args)
        phase.advance()  # the prefill's token
        t0 = time.perf_counter()
        answer = es.greedy_generate_static(m.target, torch.tensor(prompt, device=m.dev),
                                           opt.tokens, step_fn=step,
                                           stop_tokens=(m.tok.eos_id,))
        answer_s = time.perf_counter() - t0
    with Phase(m.say, f"walking the smallest tree's drafts along the answer {m.on}"):
        walk = treechoice.accepted_lengths(m.target, m.draft, [(prompt + answer, len(prompt))],
                                           [RACE_TREE])[treechoice.key_of(RACE_TREE)]
    m.setup_caches(opt)  # as a decoding finds them
    rounds: list = []
    with Phase(m.say, f"timing a greedy step against the smallest tree's, {RACE_ROUNDS} "
               f"rounds {m.on}"):
        greedy_s, step_s = treechoice.time_steps(m.target, m.draft, prompt, [RACE_TREE],
                                                 group=m.group, reps=RACE_ROUNDS,
                                                 capture=False, per_round=rounds)
    return {"rank": rank, "world": world, "backend": dist.get_backend() if m.group else "none",
            "device_name": "cpu", "tokens": answer, "answer_s": answer_s,
            "tree": RACE_TREE, "accepted": walk, "greedy_step_s": greedy_s,
            "tree_step_s": step_s[treechoice.key_of(RACE_TREE)],
            "rounds": [(g, t[0]) for g, t in rounds]}


def spec_worker(rank: int, world: int, opt: SpecOptions) -> dict:
    """One rank: decode every prompt target-only and speculatively; per-prompt results."""
    from fxcoalesce.apps.progress import Phase, first_call_announced
    from fxcoalesce.models import eagle3_static as es

    m = load(rank, world, opt)
    dev, group, dtype, say, on = m.dev, m.group, m.dtype, m.say, m.on
    target, draft, tok, head_config = m.target, m.draft, m.tok, m.head_config
    cuda = dev.type == "cuda"
    choice, tree_record = None, {}
    reports: dict[str, list] = {"decode": [], "spec": []}  # one per compiled graph
    settings = dict(mode=opt.mode) if opt.mode else {}

    def compiled(fn, label: str, **kw):
        be = backend(Config(codegen=opt.codegen), **settings,
                     on_graph=lambda before, after, report: reports.setdefault(
                         label, []).append(report))
        return torch.compile(fn, backend=be, fullgraph=True, **kw)

    # on a GPU the tree's finalists are timed as the decoding runs them: these compiled steps,
    # which decode afterwards (the chosen tree's graph is compiled already)
    decode_c = compiled(es.decode_step, "decode")
    step_c = compiled(es.spec_step, "spec")
    if opt.tree is None:
        spec = es_spec(opt)
    else:  # every rank measures the same steps; rank 0 decides, the others follow
        with Phase(say, f"sizing the speculative tree from this machine's step times {on}"):
            settings_key = f"{opt.codegen} {opt.mode}"
            choice, tree_record = treechoice.decide(
                opt.tree, target=target, draft=draft, tok=tok, head=Path(opt.draft),
                prompt=list(opt.prompts[0]), group=group, dev=dev, dtype=dtype,
                settings=settings_key, say=say, setup=lambda: m.setup_caches(opt),
                compiled=(decode_c, step_c) if cuda and opt.greedy_compiled else None)
        spec = choice.spec
        m.setup_caches(opt)  # as the compiled steps will find them
        if say:
            say(f"  tree: {choice.label()}; {choice.reason}")
    greedy_chosen = spec is None
    graphs = opt.mode == "reduce-overhead" and dev.type == "cuda"  # no CUDA graphs on a CPU
    how = f"fxcoalesce, codegen {opt.codegen}{', CUDA graphs' if graphs else ''}"
    # the first call compiles (Dynamo, AOTAutograd, the passes, the ranks' agreement)
    # greedy chosen: the greedy step is what decodes, compiled through fxcoalesce
    greedy_compiled = opt.greedy_compiled or greedy_chosen
    decode = (first_call_announced(decode_c, say,
                                   f"compiling the greedy decode step ({how}) {on}")
              if greedy_compiled else es.decode_step)
    step = None if greedy_chosen else first_call_announced(
        step_c, say,
        f"compiling the speculative step: draft tree, verify, accept ({how}) {on}")
    greedy_prefill = spec_prefill = None
    if opt.prefill_compiled:  # one graph per 64 tokens of prompt (dynamic=False: no symbols)
        greedy_prefill = compiled(es.prefill_static, "greedy_prefill", dynamic=False)
        if not greedy_chosen:
            pairs = spec.pairs

            def spec_prefill_fn(target, draft, tokens, P):
                return es.spec_prefill_static(target, draft, tokens, P, pairs)
            spec_prefill = compiled(spec_prefill_fn, "spec_prefill", dynamic=False)
    stop = (tok.eos_id,)

    def counted(fn, phase: Phase | None, greedy: bool):
        """``fn`` that advances ``phase`` by the tokens of each step (the speculative step's
        from its input, which the loop has read already: on CPU only, where that is free)."""
        if phase is None or not phase.say:
            return fn

        def call(*args):
            if greedy:
                phase.advance()
            elif not cuda and phase.count:
                phase.advance(int(args[2][1]))
            else:
                phase.advance(0 if phase.count else 1)  # the prefill's token
            return fn(*args)
        return call

    guarded = opt.tree in ("auto", "measure")  # a forced tree runs to the end

    def run_both(ids: tuple[int, ...], tokens: int, shown: bool = False,
                 greedy_too: bool = True, timed: bool = True) -> dict:
        prompt = torch.tensor(ids, device=dev)
        bars = (lambda what: Phase(say if shown else None, what, total=tokens, unit="tokens",
                                   done=""))
        if group is not None:
            dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        greedy, stepping, spec_stepping = [], [], []  # when the first step began (each
        # decoding's prefill synced: it read its first token)

        def stamped(fn, first: list):
            def call(*args):
                if not first:
                    first.append(time.perf_counter())
                return fn(*args)
            return call

        with bars(f"decoding greedily{'' if greedy_compiled else ', uncompiled,'} {on}"
                  ) as phase:
            phase.advance()  # the prefill's token
            if greedy_too:
                greedy = es.greedy_generate_static(
                    target, prompt, tokens,
                    step_fn=stamped(counted(decode, phase, True), stepping),
                    stop_tokens=stop, prefill_fn=greedy_prefill, ahead=ahead(opt))
            phase.count = len(greedy)
        _sync(dev)
        t1 = time.perf_counter()
        if greedy_chosen:  # the greedy decoding is the chosen one: nothing else to run
            return {"prompt_tokens": len(ids), "greedy_tokens": len(greedy),
                    "spec_tokens": len(greedy), "greedy_s": t1 - t0, "spec_s": t1 - t0,
                    "accepted": [1] * (len(greedy) - 1), "same_tokens": True,
                    "tokens": greedy, "greedy": greedy,
                    **dict.fromkeys(("greedy_prefill_s", "spec_prefill_s"),
                                    (stepping or [t1])[0] - t0)}
        guard = (step_rate_guard((len(greedy) - 1) / max(t1 - stepping[0], 1e-9), group, dev)
                 if guarded and timed and stepping else None)
        with bars(f"decoding speculatively {on}") as phase:
            spec_out, stats = es.speculative_generate_static(
                target, draft, prompt, tokens, spec=spec,
                step_fn=stamped(counted(step, phase, False), spec_stepping),
                stop_tokens=stop, give_up=guard, greedy_fn=counted(decode, phase, True),
                prefill_fn=spec_prefill, ahead=ahead(opt))
            phase.count = len(spec_out)
        _sync(dev)
        t2 = time.perf_counter()
        return {"prompt_tokens": len(ids), "greedy_tokens": len(greedy),
                "spec_tokens": len(spec_out), "greedy_s": t1 - t0, "spec_s": t2 - t1,
                "accepted": stats.accepted, "same_tokens": greedy == spec_out,
                "tokens": spec_out, "greedy": greedy, "greedy_from": stats.greedy_from,
                "greedy_prefill_s": (stepping or [t1])[0] - t0,
                "spec_prefill_s": (spec_stepping or [t2])[0] - t1}

    t0 = time.perf_counter()
    with torch.no_grad():
        # compile, record the graphs (an uncompiled greedy step has nothing to warm up)
        run_both(opt.prompts[0], opt.warmup_tokens, greedy_too=greedy_compiled, timed=False)
    if say:
        say(f"  compiled and warmed up in {time.perf_counter() - t0:.1f} s")
    if guarded and not greedy_chosen:  # the chosen tree as it will run, against greedy's step
        with Phase(say, f"timing the compiled speculative step against the greedy step {on}"):
            choice = treechoice.confirm(choice, tree_record, target=target, draft=draft,
                                       prompt=list(opt.prompts[0]), group=group, dev=dev,
                                       greedy_fn=decode, step_fn=step, capture=False,
                                       spec=spec)
        if choice.shape is None:
            spec, greedy_chosen = None, True
            if say:
                say(f"  tree: {choice.label()}; {choice.reason}")
    record = {"rank": rank, "world": world, "device": str(dev),
              "device_name": torch.cuda.get_device_name(dev) if cuda else "cpu",
              "backend": dist.get_backend() if group else "none",
              "warmup_s": time.perf_counter() - t0,
              "graphs": {k: len(v) for k, v in reports.items()},
              "all_reduce": {k: v[0].all_reduce for k, v in reports.items() if v},
              "verdict": {k: v[0].verdict for k, v in reports.items() if v},
              "pass_ms": {k: v[0].pass_cost_ms() for k, v in reports.items() if v},
              "head": head_config.get("training", {}),
              "tree": ({"top_k": spec.top_k, "depth": spec.depth,
                        "total_tokens": spec.total_tokens} if spec else None),
              "tree_choice": ({**tree_record, "label": choice.label(),
                               "reason": choice.reason, "greedy_chosen": greedy_chosen}
                              if choice else None),
              "settings": {k: v for k, v in asdict(opt).items() if k not in ("prompts", "gguf")},
              "torch": torch.__version__, "results": []}
    for i, ids in enumerate(opt.prompts):
        with torch.no_grad():
            r = run_both(ids, opt.tokens, shown=say is not None)
        record["results"].append(r)
        if say:  # progress: the figures come after
            say(f"  prompt {i + 1}/{len(opt.prompts)}: greedy {r['greedy_tokens']} tokens in "
                f"{r['greedy_s']:.3f} s, speculative {r['spec_tokens']} in {r['spec_s']:.3f} s "
                f"({len(r['accepted'])} steps), same tokens: {r['same_tokens']}")
        if rank == 0 and opt.progress:
            Path(opt.progress).write_text(json.dumps(summarize(record, [record]), indent=1))
    record["graphs"] = {k: len(v) for k, v in reports.items()}  # a recompile would show here
    if rank == 0 and guarded and not greedy_chosen and choice is not None:
        res = record["results"]
        realized = (sum(r["spec_tokens"] for r in res) / sum(r["spec_s"] for r in res)) / (
            sum(r["greedy_tokens"] for r in res) / sum(r["greedy_s"] for r in res))
        record["tree_choice"]["learned"] = treechoice.learn(tree_record, choice.shape, realized)
    return record


def summarize(rank0: dict, ranks: list[dict]) -> dict:
    """The benchmark record: mean accepted length, end-to-end tokens/s of both decodings."""
    res = rank0["results"]
    accepted = [a for r in res for a in r["accepted"]]
    greedy_tps = sum(r["greedy_tokens"] for r in res) / sum(r["greedy_s"] for r in res)
    spec_tps = sum(r["spec_tokens"] for r in res) / sum(r["spec_s"] for r in res)
    # each decoding's prefill (until its first step: the first token read) and the rest
    prefill = {k: sum(r.get(f"{k}_prefill_s", 0.0) for r in res) for k in ("greedy", "spec")}
    past = (sum(r["spec_tokens"] - 1 for r in res) / max(sum(r["spec_s"] for r in res)
                                                         - prefill["spec"], 1e-9)) / (
        sum(r["greedy_tokens"] - 1 for r in res) / max(sum(r["greedy_s"] for r in res)
                                                       - prefill["greedy"], 1e-9))
    return {
        "model": smollm2.NAME, "device": rank0["device_name"], "tp": rank0["world"],
        "backend": rank0["backend"], "torch": rank0["torch"],
        "mean_accepted": round(sum(accepted) / max(len(accepted), 1), 3),
        "tokens_per_s": {"target_greedy": round(greedy_tps, 1), "speculative": round(spec_tps, 1)},
        "speedup_vs_target_greedy": round(spec_tps / greedy_tps, 3),
        "prefill_s": {"target_greedy": round(prefill["greedy"], 4),
                      "speculative": round(prefill["spec"], 4)},
        "speedup_past_prefill": round(past, 3),
        "tree": rank0["tree"], "tree_choice": rank0.get("tree_choice"), "prompts": len(res),
        "new_tokens": {"target_greedy": sum(r["greedy_tokens"] for r in res),
                       "speculative": sum(r["spec_tokens"] for r in res)},
        "same_tokens_as_greedy": sum(r["same_tokens"] for r in res),
        "ranks_agree": all([x["tokens"] for x in r["results"]] == [x["tokens"] for x in res]
                           for r in ranks),
        "all_reduce_per_call": rank0["all_reduce"], "graphs_compiled": rank0["graphs"],
        "verdict": rank0.get("verdict", {}), "pass_ms": rank0.get("pass_ms", {}),
        "warmup_s": round(rank0["warmup_s"], 1),
        "settings": rank0["settings"], "head_training": rank0["head"],
        "greedy_took_over": [r.get("greedy_from") for r in res],
        "per_prompt": [{"prompt_tokens": r["prompt_tokens"], "greedy_tokens": r["greedy_tokens"],
                        "spec_tokens": r["spec_tokens"], "greedy_s": round(r["greedy_s"], 4),
                        "spec_s": round(r["spec_s"], 4), "steps": len(r["accepted"]),
                        "greedy_prefill_s": round(r.get("greedy_prefill_s", 0.0), 4),
                        "spec_prefill_s": round(r.get("spec_prefill_s", 0.0), 4),
                        "same_tokens": r["same_tokens"]} for r in res],
    }
