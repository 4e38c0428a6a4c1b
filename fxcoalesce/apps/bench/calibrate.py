"""``fxcoalesce calibrate``: measure all_reduce latency on real ranks and fit the cost model.

    fxcoalesce calibrate --tp 2 --out profile.json                      # gloo, CPU
    fxcoalesce calibrate --tp 2 --backend nccl --device cuda --nccl-mode p2p-off --out p.json
    fxcoalesce calibrate --tp 1 --backend nccl --device cuda --out p.json   # one GPU

Sizes run from 8 B to 64 MiB, two per octave. On CPU each point is the median over repeated
back-to-back loops of wall time; on CUDA, of CUDA-event time around the replay of a CUDA graph
that captured the loop (the way torch.compile's CUDA-graph trees capture collectives), or an
eager loop when capture is off or fails. On CUDA ranks of an NCCL group the other
implementations the ``lower`` and ``fuse_norm`` passes choose from are measured the same way,
interleaved with NCCL, after a correctness check of each (``calibrate_impls``). The fit is
piecewise alpha-beta (``fit``: fewest segments, least squares on relative error refined to
the smallest worst error; up to 4 segments: gloo switches algorithm between 256 KB and
3 MB), one per implementation, which ``CostModel.from_profile`` reads back.
Then ``measure_overlap``: how much of an all_reduce in flight a matmul hides (the profile's
``overlap.efficiency``, which the cost model scales every overlap window by).
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

from fxcoalesce.apps.bench.fit import _line, fit, fit_rows  # noqa: F401 (fit: re-exported)

FLOAT_BYTES = 4
IMPLS = ("one_shot", "two_shot", "fused_add_rms_norm")
"""What ``calibrate`` measures beside NCCL on CUDA ranks of an NCCL group by default;
``--impls nccl_symm`` measures NCCL's symmetric kernels, in a run of their own (torch's
symmetric-memory backend is process-wide: ``calibrate_impls.choose_backend``)."""
NCCL_MODES = {"nvlink": {}, "p2p-off": {"NCCL_P2P_DISABLE": "1"}}


def sizes(min_bytes: int = 8, max_bytes: int = 64 << 20) -> list[int]:
    """Two sizes per octave (2^k and 1.5 * 2^k bytes), multiples of a float32."""
    out, b = [], min_bytes
    while b <= max_bytes:
        out += [s for s in (b, b * 3 // 2) if s <= max_bytes and s % FLOAT_BYTES == 0]
        b *= 2
    return out


def _loop_us(run, reps: int, loops: int, sync) -> float:
    """Median over ``loops`` of the per-call time of ``reps`` back-to-back calls."""
    times = []
    for _ in range(loops):
        sync()
        start = time.perf_counter()
        run(reps)
        sync()
        times.append((time.perf_counter() - start) * 1e6 / reps)
    return statistics.median(times)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _cuda_loop(call, reps: int, cudagraphs: bool, dev: torch.device):
    """A callable timing ``reps`` back-to-back ``call()`` s with CUDA events (µs per call):
    the replay of a CUDA graph that captured them, or the eager loop when capture is off or
    fails on any rank. ``.captured`` says which, ``.capture_error`` why not."""
    def eager():
        for _ in range(reps):
            call()

    replay, captured, error = eager, False, None
    if cudagraphs:
        try:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            # thread_local: NCCL's watchdog thread may query events while this thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                eager()
            replay, captured = graph.replay, True
        except RuntimeError as e:
            torch.cuda.synchronize()
            error = _first_line(e)
        # a graph replays its collectives only if every rank captured: agree before any replay
        ok = torch.tensor([1 if captured else 0], device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok):
            replay, captured = eager, False
            error = error or "another rank's capture failed"
    replay()

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    timed.captured, timed.capture_error = captured, error
    return timed


def _reps(call, share_s: float, passes: int, sync, dev: torch.device) -> int:
    """Warm ``call`` up and say how many back-to-back calls fill ``share_s / passes`` (the
    slowest rank's guess: every rank runs the same calls)."""
    call()
    sync()
    start = time.perf_counter()
    call()
    sync()
    guess = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
    dist.all_reduce(guess, op=dist.ReduceOp.MAX)
    return max(1, min(50, int(share_s / passes / max(float(guess), 1e-6))))


def calibrate_worker(rank: int, world: int, byte_sizes: list[int], device: str,
                     cudagraphs: bool, budget_s: float, impls: tuple[str, ...] = (),
                     passes: int = 15) -> dict:
    """One rank's measurements: NCCL's (or gloo's) {bytes: µs} and, on CUDA ranks of an NCCL
    group, each implementation of ``impls`` that passed its correctness check
    (``calibrate_impls.prepare``), and whether CUDA graphs were used.

    Every (implementation, size) is measured round-robin over ``passes`` passes (in reverse
    order on odd passes) and keeps its median, so a slow spell of the machine spreads over
    all of them instead of bending one curve or one part of a fit. ``budget_s`` is shared by
    the implementations measured: the time per size stays about the same with more of them.
    """
    cuda = device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.set_num_threads(1)  # the ranks and gloo's threads share the cores
    tensors = {b: torch.zeros(b // FLOAT_BYTES, device=dev) for b in byte_sizes}
    calls = {("nccl", b): (lambda t=t: dist.all_reduce(t)) for b, t in tensors.items()}
    facts = None
    if cuda and impls and dist.get_backend() == "nccl":
        from fxcoalesce.apps.bench.calibrate_impls import prepare

        more, facts = prepare(impls, byte_sizes, dev)
        calls.update(more)
    order = sorted(calls, key=lambda case: (case[1], case[0] != "nccl", case[0]))
    share = budget_s / len({impl for impl, _ in calls})
    reps = {case: _reps(calls[case], share, passes, sync, dev) for case in order}
    loops = {case: _cuda_loop(calls[case], reps[case], cudagraphs, dev) for case in order
             } if cuda else {}
    runs: dict[tuple, list[float]] = {case: [] for case in order}
    for p in range(passes):
        for case in order if p % 2 == 0 else order[::-1]:
            dist.barrier()
            if cuda:
                runs[case].append(loops[case]())
            else:
                call = calls[case]
                runs[case].append(_loop_us(lambda k: [call() for _ in range(k)], reps[case],
                                           1, sync))
    median = {case: statistics.median(v) for case, v in runs.items()}
    points = {b: median["nccl", b] for b in byte_sizes}
    used = cuda and all(loops["nccl", b].captured for b in byte_sizes)
    overlap = [measure_overlap(nbytes, dev, cuda and cudagraphs, passes)
               for nbytes in OVERLAP_BYTES if nbytes <= max(byte_sizes)]
    out = {"points": points, "cudagraphs": used, "compute": compute_constants(dev),
           "overlap": overlap}
    if facts is not None:
        names = [impl for impl in impls if any(i == impl for i, _ in calls)]
        facts["points"] = {impl: {b: m for (i, b), m in median.items() if i == impl}
                           for impl in names}
        facts["captured"] = {impl: [loops[c].captured for c in order if c[0] == impl]
                             for impl in names}
        facts["capture_errors"] = {impl: next((loops[c].capture_error for c in order
                                               if c[0] == impl and loops[c].capture_error),
                                              None) for impl in names}
        out["impls"] = facts
    return out


OVERLAP_BYTES = (64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
"""all_reduce sizes at which ``measure_overlap`` runs (those up to ``--max-bytes``)."""


def measure_overlap(nbytes: int, dev: torch.device, cudagraphs: bool, passes: int) -> dict:
    """How much of an all_reduce a matmul issued between its start and its wait hides.

    Three programs, each timed like the latency points (CUDA graphs on GPU, medians over
    ``passes``), the way compiled code issues a collective (``_c10d_functional.all_reduce``,
    compute, ``wait_tensor``): the all_reduce alone (``comm``), the matmuls alone
    (``compute``, sized to last about as long), and the all_reduce in flight while the matmuls
    run (``both``). ``efficiency = (comm + compute - both) / min(comm, compute)``: 1 when the
    shorter one is completely hidden, 0 when they serialise (NCCL's kernels and the matmul
    share the SMs and, with P2P off, the copy path). Every rank runs the same programs."""
    cuda = dev.type == "cuda"
    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    t = torch.zeros(nbytes // FLOAT_BYTES, device=dev)
    n, dtype = (2048, torch.bfloat16) if cuda else (128, torch.float32)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def comm():
        c10d.wait_tensor(c10d.all_reduce(t, "sum", group))

    def matmuls(k):
        for _ in range(k):
            torch.mm(a, b)

    def time_us(fn) -> float:
        run = _capture(fn, dev) if cuda and cudagraphs else fn
        run()
        out = []
        for _ in range(passes):
            dist.barrier()
            sync()
            start = time.perf_counter()
            if cuda:
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
                run()
                end.record()
                end.synchronize()
                out.append(begin.elapsed_time(end) * 1e3)
            else:
                run()
                out.append((time.perf_counter() - start) * 1e6)
        return statistics.median(out)

    comm_us = time_us(comm)
    one = time_us(lambda: matmuls(1))
    # the same number of matmuls on every rank: the slowest rank's count
    k = torch.tensor([max(1, round(comm_us / max(one, 1e-3)))], device=dev)
    dist.all_reduce(k, op=dist.ReduceOp.MAX)
    k = int(k)
    compute_us = time_us(lambda: matmuls(k))

    def both():
        handle = c10d.all_reduce(t, "sum", group)
        matmuls(k)
        c10d.wait_tensor(handle)

    both_us = time_us(both)
    eff = (comm_us + compute_us - both_us) / max(min(comm_us, compute_us), 1e-9)
    return {"bytes": nbytes, "comm_us": round(comm_us, 2), "compute_us": round(compute_us, 2),
            "matmuls": k, "both_us": round(both_us, 2),
            "efficiency": round(min(1.0, max(0.0, eff)), 3)}


def _capture(fn, dev: torch.device):
    """``fn`` captured in a CUDA graph (every rank captures, or none: then ``fn`` itself)."""
    graph, ok = torch.cuda.CUDAGraph(), True
    try:
        fn()  # warm-up outside the capture (NCCL's lazy setup)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        ok = False
    flag = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return graph.replay if int(flag) else fn


def compute_constants(dev: torch.device) -> dict:
    """Measured roofline constants of this device: matmul TFLOP/s, copy GB/s, launch µs."""
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    src = torch.randn((64 << 20) // 4 if cuda else (16 << 20) // 4, device=dev)
    small = torch.randn(16, device=dev)

    def best(fn, reps=5):
        fn()
        sync()
        out = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
        return min(out)

    mm_s = best(lambda: torch.mm(a, b))
    copy_s = best(lambda: src.clone())
    launch_s = best(lambda: [small.add(1) for _ in range(100)]) / 100
    return {"peak_tflops": round(2 * n**3 / mm_s / 1e12, 3),
            "memory_gbps": round(2 * src.numel() * 4 / copy_s / 1e9, 1),
            "kernel_us": round(launch_s * 1e6, 2)}


def profile(results: list[dict], *, backend: str, device: str, world: int,
            nccl_mode: str | None, command: str) -> dict:
    """The profile.json content: each size's slowest rank, the fits and their errors; on
    CUDA ranks of an NCCL group also ``symm_mem``, ``implementations`` (one fitted curve per
    implementation measured, the format ``CostModel.from_profile`` reads) and
    ``implementations_left_out`` (implementation: why)."""
    points = {b: max(r["points"][b] for r in results) for b in results[0]["points"]}
    segments, rows, worst = fit_rows(points)
    alpha, beta = _line(sorted(points.items()))
    impls = {}
    if "impls" in results[0]:
        from fxcoalesce.apps.bench.calibrate_impls import implementations_section

        impls = implementations_section([r["impls"] for r in results])
    return {
        "backend": backend, "device": device, "world_size": world, "nccl_mode": nccl_mode,
        "alpha_us": round(alpha, 3), "beta_us_per_byte": beta, "segments": segments,
        "points": rows, "max_abs_error_1KB_16MB": worst,
        "cudagraphs": results[0]["cudagraphs"], "compute": results[0]["compute"],
        **overlap_summary(results), **impls,
        "torch": torch.__version__, "nccl": _nccl_version() if backend == "nccl" else None,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "date": date.today().isoformat(), "command": command,
    }


def overlap_summary(results: list[dict]) -> dict:
    """``{"overlap": {"efficiency": median over sizes, "points": [...]}}`` from every rank's
    measurements: per size, the rank whose overlapped program ran slowest. Empty when no size
    was measured."""
    per_size = zip(*(r.get("overlap", []) for r in results))
    points = [max(ranks, key=lambda p: p["both_us"]) for ranks in per_size]
    if not points:
        return {}
    return {"overlap": {"efficiency": statistics.median(p["efficiency"] for p in points),
                        "points": points}}


def _nccl_version() -> str | None:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        return None


def run_calibrate(args) -> dict:
    from fxcoalesce.apps.launch import spawn

    backend = args.backend or "gloo"
    env = NCCL_MODES[args.nccl_mode] if backend == "nccl" else {}
    byte_sizes = sizes(max_bytes=args.max_bytes)
    # gloo runs its collectives from the host: a CUDA graph cannot capture them, and the
    # failed capture broke the run (torch 2.11: "Offset increment outside graph capture")
    cudagraphs = not args.no_cudagraphs and backend == "nccl"
    # the other implementations need CUDA ranks of an NCCL group (symmetric memory)
    chosen = getattr(args, "impls", None)  # None: all; () with --impls nccl
    impls = (IMPLS if chosen is None else tuple(chosen)) if (
        backend == "nccl" and args.device == "cuda") else ()
    results = spawn(calibrate_worker, args.tp,
                    (byte_sizes, args.device, cudagraphs, args.budget, impls),
                    backend=backend, env=env)
    return profile(results, backend=backend, device=args.device, world=args.tp,
                   nccl_mode=args.nccl_mode if backend == "nccl" else None,
                   command=args.command_line)


def write_profile(data: dict, path: str) -> None:
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
