"""``fxcoalesce bench``: one model step on real ranks, run several ways, timed side by side.

    fxcoalesce bench                                   # neox-tiny, TP 2 gloo, CPU, 3 tokens
    fxcoalesce bench --model falcon-40b --layers 4 --step verify --tokens 16 --device cuda \\
        --backend nccl --cudagraphs --nccl-mode p2p-off --out results/

The variants (``bench_variants.VARIANTS``) run in the same rank processes on the same weights
and inputs, one token count at a time:

1. an eager call gives the reference output;
2. each variant's first call compiles it (progress on stderr), behind a code object of its
   own so that dynamo's cache for one variant never serves another, and into an Inductor
   cache of its own after an untimed warm-up compile (``compile_timing``: a later variant
   neither reuses an earlier one's kernels nor escapes the one-time costs); the count of
   graphs dynamo made for it is checked (one, and none after);
3. one more call per variant runs under ``torch.profiler`` (CPU op events) and counts the
   ``_c10d_functional.all_reduce*`` ops it issues and the bytes they reduce. Under CUDA
   graphs a replay issues no ops, so this call is sent down CUDA-graph trees' eager warm-up
   path (``triton.force_cudagraphs_warmup``): the same compiled code, not captured;
4. ``warmup`` untimed and ``steps`` timed rounds: each round calls every variant once,
   after a barrier, in the variants' order on even rounds and reversed on odd ones, so no
   variant always runs first or right after another. A step's time is the slowest rank's
   (``timing.timed``: CUDA events on GPU); the error is the largest absolute difference of
   the last timed output from the eager reference. With ``calls_per_sample`` k > 1 (the
   default on CUDA: 10) a variant's turn is k calls back to back, timed together and
   divided by k: a barrier before every single step adds the ranks' start skew, which the
   step's first collective waits out, to every sample (on two H200s that was ~0.35 ms of a
   1.3 ms falcon step, and noise large enough to hide a 1% difference);
5. with ``--trace``, each compiled variant is called a few more times under ``torch.profiler``
   (GPU kernels on CUDA) and rank 0's chrome trace is written next to bench.json, with the
   collectives' time per step and the part of it no compute kernel overlapped.

A "verify" step of a dense model (no KV cache) is its plain forward over the tokens.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxcoalesce.apps.bench import compile_timing
from fxcoalesce.apps.bench.records import environment, merge_ranks, percentile  # noqa: F401
from fxcoalesce.apps.bench.timing import timed
from fxcoalesce.apps.bench.variants import (DEFAULT_VARIANTS, compile_variant,
                                            has_hand_merged, hand_merged_twin, option_tiers,
                                            unavailable)
from fxcoalesce.apps.steps import make_step


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    """What one ``fxcoalesce bench`` run measures."""

    model: str = "neox-tiny"
    """Model name (``fxcoalesce.models.model_names()``)."""
    step: str = "forward"
    """"forward" or "verify" (dense models: a plain forward over the tokens)."""
    tokens: tuple[int, ...] = (3,)
    """Token counts, each measured in turn in the same processes."""
    layers: int | None = None
    """Override of the model's number of layers."""
    dim: int | None = None
    """Override of the model's hidden size (``models.args_of``)."""
    tp: int = 2
    """Ranks, one process each."""
    backend: str = "gloo"
    """Process group backend."""
    device: str = "cpu"
    """Where weights and activations live: bf16 on "cuda", fp32 on "cpu"."""
    cudagraphs: bool = False
    """Compile with mode="reduce-overhead" (CUDA graphs) for every compiled variant."""
    nccl_mode: str | None = None
    """NCCL only: "nvlink" (NCCL's default transports) or "p2p-off" (NCCL_P2P_DISABLE=1)."""
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    """Which variants to run, in this order (``variants.VARIANTS`` names them all)."""
    steps: int = 100
    """Timed rounds."""
    calls_per_sample: int = 1
    """Back-to-back calls of a variant inside one timed sample (its time is divided by it).
    More than 1 measures a step the way a decode loop runs it: ranks in lockstep through
    their collectives, not restarted from a barrier each step (whose skew between ranks
    the first collective of a step otherwise waits out)."""
    warmup: int = 10
    """Untimed rounds after compilation (at least 3 with CUDA graphs: record, then replay)."""
    command: str = ""
    """The command line, recorded in the results."""
    progress: bool = True
    """Rank 0 says on stderr what it is doing and how long each part took."""
    warm_up_compilers: bool = True
    """Pay the process's one-time compile costs on a tiny graph first, untimed, so that the
    variants' compile times compare (``compile_timing.warm_up``). ``fxcoalesce demo``, which
    shows no compile times, skips it."""
    trace_dir: str | None = None
    """If set, after timing: a ``torch.profiler`` chrome trace (CPU ops and, on GPU, kernels)
    of ``TRACE_CALLS`` calls of each compiled variant, rank 0's, written here as
    ``trace_<variant>_t<tokens>.json`` and summarised in the record."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def rounds_before_timing(self) -> int:
        # CUDA-graph trees: the compiling call warms up, the next records, then replays
        return max(self.warmup, 3) if self.cudagraphs else self.warmup


_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def _event_bytes(event, itemsize: int) -> int:
    """Bytes of the first (tensor or tensor-list) input of a profiler op event."""
    shape = event.input_shapes[0] if event.input_shapes else []
    shapes = shape if shape and isinstance(shape[0], list) else [shape]
    dtypes = getattr(event, "input_dtypes", None) or []
    size = _ITEMSIZE.get(dtypes[0], itemsize) if dtypes else itemsize
    return sum(size * (int(torch.Size(s).numel()) if s else 0) for s in shapes)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2: Kineto logs a profiler_start/stop line per profile there
    (torch 2.13), and no setting turns that off."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


LOWERED_OPS = {"symm_mem::one_shot_all_reduce": "one_shot",
               "symm_mem::two_shot_all_reduce_": "two_shot",
               "fxcoalesce::all_reduce_add_rms_norm": "fused_add_rms_norm"}
"""The ops an all_reduce runs as when it is not NCCL's (fxcoalesce's lowering, Inductor's
one-shot), by the implementation's name in the profile."""


def count_collectives(call, itemsize: int) -> dict:
    """Run ``call()`` once under ``torch.profiler`` (CPU ops, shapes) and count what it
    issued: all_reduces, whatever runs them (each ``_c10d_functional`` all_reduce is one
    process-group launch, fused buckets included; ``lowered`` counts those run by a
    symmetric-memory or fused op instead), the bytes they reduce, and the other collectives
    by name."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    launches, nbytes, other, lowered = 0, 0, Counter(), Counter()
    for e in prof.events():
        namespace, _, op = e.name.partition("::")
        if e.name in LOWERED_OPS:
            lowered[LOWERED_OPS[e.name]] += 1
        elif namespace != "_c10d_functional" or op.startswith("wait"):
            continue
        elif not op.startswith("all_reduce"):
            other[op.rstrip("_")] += 1
            continue
        launches += 1
        nbytes += _event_bytes(e, itemsize)
    return {"all_reduce_launches": launches, "bytes": nbytes, "other_collectives": dict(other),
            "lowered": dict(lowered)}


TRACE_CALLS = 5


def trace_variant(r: "_Rank", call, filename: str) -> dict:
    """``call()`` ``TRACE_CALLS`` times under ``torch.profiler`` on every rank (collectives
    need all of them); rank 0 writes the chrome trace to ``trace_dir/filename`` and returns,
    per call, the compute kernels (ops on CPU), the collectives' time on the device and the
    part of it that no compute overlapped (``draw.read_chrome_trace``). Others return {}."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    from fxcoalesce.viz.draw import read_chrome_trace

    cuda = r.dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dist.barrier()
    with _quiet_stderr(), profile(activities=activities) as prof:
        for _ in range(TRACE_CALLS):
            call()
        if cuda:
            torch.cuda.synchronize(r.dev)
    if r.rank != 0:
        return {}
    path = Path(r.opt.trace_dir) / filename
    prof.export_chrome_trace(str(path))
    tl = read_chrome_trace(path)
    n = TRACE_CALLS
    return {"file": path.name, "calls": n, "source": tl.title.rpartition("(")[2].rstrip(")"),
            "compute_spans": round(len(tl.compute) / n, 1),
            "collective_us": round(tl.comm_us / n, 1),
            "exposed_us": round((tl.comm_us - tl.hidden_us) / n, 1)}


def _graphs_made() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _cudagraph_skips() -> int:
    """Graphs Inductor left out of CUDA graphs (it logs why: mutated inputs, CPU ops ...)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def _agree_failed(failed: bool, dev: torch.device) -> bool:
    """Whether any rank failed (every rank must take the same path after a compile)."""
    flag = torch.tensor([1.0 if failed else 0.0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]


class _Rank:
    """One rank's state for a run: device, printing, the model and its hand-merged twin."""

    def __init__(self, rank: int, world: int, opt: BenchOptions):
        from fxcoalesce import models

        self.opt, self.rank = opt, rank
        cuda = opt.device == "cuda"
        self.dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else \
            torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.dev)  # gloo ranks sharing GPUs: not set by spawn
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        group = dist.group.WORLD
        size = ", ".join(([f"{opt.layers} layers"] if opt.layers else [])
                         + ([f"hidden {opt.dim}"] if opt.dim else []))
        self.say(f"building {opt.model}{f' ({size})' if size else ''} "
                 f"on {self.dev.type} ({str(opt.dtype).removeprefix('torch.')}), sharding it "
                 f"over {world} ranks ...")
        self.model = models.apply_tp(models.build(opt.model, dtype=opt.dtype, device=self.dev,
                                                  layers=opt.layers, dim=opt.dim), group)
        self.twin = (hand_merged_twin(self.model)
                     if "hand-merged" in opt.variants and has_hand_merged(opt.model) else None)

    def say(self, text: str) -> None:
        if self.rank == 0 and self.opt.progress:
            print(text, file=sys.stderr, flush=True)

    def phase(self, what: str, **kw):
        """``progress.Phase`` on rank 0's stderr: what it does, "still ..." while it lasts."""
        from fxcoalesce.apps.progress import Phase

        return Phase(self.say if self.rank == 0 and self.opt.progress else None, what, **kw)

    def call(self, fn, args: tuple):
        """``fn(*args)``, as a step of its own for CUDA-graph trees (each call a new
        generation: no variant's graph is recorded as the child of another's)."""
        if self.opt.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(*args)

    def step(self, model, tokens: int):
        """(callable, inputs on the device) of this run's step at ``tokens`` tokens."""
        step = self.opt.step if hasattr(model, "setup_cache") else "forward"
        fn, args = make_step(model, step, tokens)
        ids = torch.randint(0, self.model.args.vocab, args[0].shape,
                            generator=torch.Generator().manual_seed(1))
        return fn, tuple(a.to(self.dev) for a in (ids, *args[1:]))


def bench_worker(rank: int, world: int, opt: BenchOptions) -> list[dict]:
    """One rank's part of a bench run: per token count, per variant, its step times (µs),
    collectives counted, output error and compile time."""
    r = _Rank(rank, world, opt)
    if opt.warm_up_compilers and any(name != "eager" and not unavailable(name, opt.device,
                                                                          opt.backend)
                                     for name in opt.variants):  # something will compile
        with r.phase("warming up the compilers (a tiny graph through Inductor and "
                     "fxcoalesce, untimed)"):
            compile_timing.warm_up(r.dev, dist.group.WORLD)
    with torch.no_grad():
        return [_bench_tokens(r, tokens) for tokens in opt.tokens]


def _compile_all(r: _Rank, fns: dict, args: tuple, tokens: int):
    """Compile each variant by its first call; returns (callables, facts, skipped)."""
    opt = r.opt
    calls, facts, skipped = {}, {}, {}
    for i, name in enumerate(opt.variants, 1):
        if name == "hand-merged" and r.twin is None:
            skipped[name] = f"{opt.model} has no hand-merged code (sequential blocks)"
            continue
        why = unavailable(name, opt.device, opt.backend) or (
            _symm_mem_for_group(r) if name == "inductor-one-shot" else None)
        if why:
            skipped[name] = why
            continue
        tiers = option_tiers(name, opt.device, opt.cudagraphs)
        if isinstance(tiers, str):
            skipped[name] = tiers
            continue
        failures = []
        for k, options in enumerate(tiers):
            reports: list = []
            fn = compile_variant(name, fns[name], f"fxcoalesce bench {name} tokens={tokens} "
                                 f"try={k}", cudagraphs=opt.cudagraphs, options=options,
                                 on_graph=lambda b, a, report, reports=reports:
                                 reports.append(report), world=dist.get_world_size())
            what = "running" if name == "eager" else "compiling"
            dist.barrier()
            graphs, skips = _graphs_made(), _cudagraph_skips()
            if name == "inductor-one-shot":  # its P2P buffers: ids of this graph's own
                from fxcoalesce.lowering import distinct_p2p_ids

                distinct_p2p_ids(f"inductor-one-shot {opt.model} tokens={tokens} try={k}")
            error, seconds, info = None, None, {"cache": None}
            cache = (compile_timing.own_cache(name) if name != "eager"
                     else contextlib.nullcontext(info))
            codes: list[str] = []
            start = time.perf_counter()
            try:
                with cache as info, _output_code(codes), r.phase(
                        f"{what} {name} ({i}/{len(opt.variants)}) on {dist.get_world_size()} "
                        "ranks", prefix="  ", done=""):
                    r.call(fn, args)
                    seconds = time.perf_counter() - start
                    # CUDA-graph trees record on the second call and replay on the third: a
                    # graph that cannot be recorded (torch 2.11 flags Inductor's own P2P
                    # buffers as leaked) fails here, as this variant's failure, not in the
                    # timing loop
                    for _ in range(2 if opt.cudagraphs and name != "eager" else 0):
                        r.call(fn, args)
            except Exception as e:  # noqa: BLE001 - reported, and every rank moves on alike
                error = _first_line(e)
            seconds = time.perf_counter() - start if seconds is None else seconds
            if _agree_failed(error is not None, r.dev):
                failures.append(error or "failed on another rank")
                r.say(f"    {name} failed to compile: {failures[-1]}")
                continue
            calls[name] = fn
            facts[name] = {"compile_s": round(seconds, 2), "compile_cache": info["cache"],
                           "graphs": _graphs_made() - graphs,
                           "cudagraph_skips": _cudagraph_skips() - skips,
                           "options": options, "reports": reports, "failed_tiers": failures,
                           "hidden_kernels": hidden_kernels(codes)}
            r.say(f"    done in {seconds:.1f} s"
                  + (f" ({info['cache']} Inductor cache of its own)" if info["cache"] else ""))
            break
        else:
            skipped[name] = f"failed to compile: {'; '.join(failures)}"
    return calls, facts, skipped


@contextlib.contextmanager
def _output_code(codes: list[str]):
    """Collect the wrapper code Inductor generates inside (``run_and_get_code`` without its
    ``torch._dynamo.reset()``)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield


def hidden_kernels(codes: list[str]) -> list[int] | None:
    """Per all_reduce of the generated code, in launch order, the kernels launched between its
    issue and its wait (``code_overlap``); None when nothing was generated (eager)."""
    from fxcoalesce.apps.bench.code_overlap import collective_windows

    if not codes:
        return None
    return [w.kernels for code in codes for w in collective_windows(code)
            if w.op.startswith("all_reduce")]


def _symm_mem_for_group(r: _Rank) -> str | None:
    """Symmetric memory enabled for the world group, for ``inductor-one-shot``, once it is
    tested usable on every rank (collective; the same verdict on every rank); why not."""
    from fxcoalesce.apps.bench.calibrate_impls import enable_symm_mem, symm_mem_status

    group = dist.group.WORLD.group_name
    status = symm_mem_status(group, r.dev)
    if not status["usable"]:
        return f"symmetric memory is not usable: {status['why']}"
    enable_symm_mem(group)
    return None


def _bench_tokens(r: _Rank, tokens: int) -> dict:
    opt = r.opt
    torch._dynamo.reset()  # nothing compiled for another token count is looked at again
    fn, args = r.step(r.model, tokens)
    fns = {name: fn for name in opt.variants}
    if r.twin is not None:
        fns["hand-merged"] = r.step(r.twin, tokens)[0]
    r.say(f"{opt.model} {opt.step}, {tokens} tokens, TP {opt.tp}:")
    reference = fn(*args).float().clone()
    calls, facts, skipped = _compile_all(r, fns, args, tokens)
    itemsize = opt.dtype.itemsize

    r.say("  counting collectives (profiler) ...")
    start = time.perf_counter()
    for name, call in calls.items():  # not captured: CUDA-graph replays issue no ops
        with torch._inductor.config.patch({"triton.force_cudagraphs_warmup": True}):
            facts[name].update(count_collectives(lambda: r.call(call, args), itemsize))
    r.say(f"    done in {time.perf_counter() - start:.1f} s")
    graphs = _graphs_made()
    before = r.opt.rounds_before_timing
    k = opt.calls_per_sample
    r.say(f"  timing: {before} warm-up + {opt.steps} timed rounds, each variant once per "
          f"round{f' ({k} calls back to back)' if k > 1 else ''}, alternating order ...")

    def sample(call):
        out = None
        for _ in range(k):
            out = r.call(call, args)
        return out
    times = {name: [] for name in calls}
    names = list(calls)
    start, total = time.perf_counter(), before + opt.steps
    with r.phase("timing", total=total, unit="rounds", prefix="  ", done="",
                 announce=False) as phase:
        for round_ in range(total):
            for name in names if round_ % 2 == 0 else names[::-1]:
                dist.barrier()
                out, us = timed(lambda: sample(calls[name]), r.dev)
                if round_ >= before:
                    times[name].append(us / k)
                if round_ == before + opt.steps - 1:
                    facts[name]["max_abs_err"] = float((out.float() - reference).abs().max())
            phase.advance()
    r.say(f"    timed in {time.perf_counter() - start:.1f} s")
    if opt.trace_dir:
        r.say(f"  tracing {TRACE_CALLS} calls of each compiled variant (torch.profiler) ...")
        start = time.perf_counter()
        for name, call in calls.items():
            if name != "eager":
                facts[name]["trace"] = trace_variant(r, lambda: r.call(call, args),
                                                     f"trace_{name}_t{tokens}.json")
        r.say(f"    done in {time.perf_counter() - start:.1f} s")
    for name in calls:
        f = facts[name]
        f["times_us"] = times[name]
        f["recompiled"] = _graphs_made() != graphs
        f["predicted_comm_us"] = [rep.predicted_comm_us for rep in f["reports"]]
        f["pass_ms"] = [rep.pass_cost_ms() for rep in f["reports"]]
        f["reports"] = [rep.all_reduce for rep in f["reports"]]
    notes = [] if hasattr(r.model, "setup_cache") or opt.step == "forward" else [
        f"{opt.model} has no KV cache: its verify step is a plain forward over the tokens"]
    return {"tokens": tokens, "variants": facts, "skipped": skipped, "notes": notes}


def run_bench(opt: BenchOptions) -> list[dict]:
    """Spawn the ranks, run the bench, return one record per token count."""
    from fxcoalesce.apps.bench.calibrate import NCCL_MODES
    from fxcoalesce.apps.launch import spawn

    env = NCCL_MODES[opt.nccl_mode] if opt.backend == "nccl" else {}
    per_rank = spawn(bench_worker, opt.tp, (opt,), backend=opt.backend, env=env)
    return merge_ranks(per_rank, opt, environment(opt.device))
