"""``fxcoalesce calibrate``: measure all_reduce latency on real ranks and fit the cost model.

    fxcoalesce calibrate --tp 2 --out profile.json                      # gloo, CPU
    fxcoalesce calibrate --tp 2 --backend nccl --device cuda --nccl-mode p2p-off --out p.json

Sizes run from 8 B to 64 MiB, two per octave. On CPU each point is the median over repeated
back-to-back loops of wall time; on CUDA, of CUDA-event time around the replay of a CUDA graph
that captured the loop (the way torch.compile's CUDA-graph trees capture collectives), or an
eager loop when capture is off or fails. The fit is piecewise alpha-beta (fewest segments,
least squares on relative error refined to the smallest worst error; up to 4 segments:
gloo switches algorithm between 256 KB and 3 MB), which ``CostModel.from_profile`` reads back.
Then ``measure_overlap``: how much of an all_reduce in flight a matmul hides (the profile's
``overlap.efficiency``, which the cost model scales every overlap window by).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

FLOAT_BYTES = 4
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


def _cuda_loop(t: torch.Tensor, reps: int, cudagraphs: bool):
    """A callable timing ``reps`` back-to-back all_reduces of ``t`` with CUDA events (µs per
    call): the replay of a CUDA graph that captured them, or the eager loop when capture is
    off or fails. ``.captured`` says which."""
    def eager():
        for _ in range(reps):
            dist.all_reduce(t)

    replay, captured = eager, False
    if cudagraphs:
        try:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            # thread_local: NCCL's watchdog thread may query events while this thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                eager()
            replay, captured = graph.replay, True
        except RuntimeError:
            torch.cuda.synchronize()
        # a graph replays its collectives only if every rank captured: agree before any replay
        ok = torch.tensor([1 if captured else 0], device=t.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok):
            replay, captured = eager, False
    replay()

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    timed.captured = captured
    return timed


def calibrate_worker(rank: int, world: int, byte_sizes: list[int], device: str,
                     cudagraphs: bool, budget_s: float, passes: int = 15) -> dict:
    """One rank's measurements: {bytes: µs}, and whether CUDA graphs were used.

    Sizes are measured round-robin over ``passes`` passes and each size keeps its median, so
    a slow spell of the machine spreads over all sizes instead of bending one part of the fit.
    """
    cuda = device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.set_num_threads(1)  # the ranks and gloo's threads share the cores
    tensors = {b: torch.zeros(b // FLOAT_BYTES, device=dev) for b in byte_sizes}
    reps = {}
    for nbytes, t in tensors.items():  # warm-up, and how many calls fill the budget
        dist.all_reduce(t)
        sync()
        start = time.perf_counter()
        dist.all_reduce(t)
        sync()
        guess = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
        dist.all_reduce(guess, op=dist.ReduceOp.MAX)  # every rank runs the same calls
        reps[nbytes] = max(1, min(50, int(budget_s / passes / max(float(guess), 1e-6))))
    runs: dict[int, list[float]] = {b: [] for b in byte_sizes}
    captured = cuda and cudagraphs
    loops = {b: _cuda_loop(t, reps[b], captured) if cuda else None for b, t in tensors.items()}
    for _ in range(passes):
        for nbytes, t in tensors.items():
            dist.barrier()
            if cuda:
                runs[nbytes].append(loops[nbytes]())
            else:
                runs[nbytes].append(_loop_us(
                    lambda k, t=t: [dist.all_reduce(t) for _ in range(k)], reps[nbytes], 1, sync))
    points = {b: statistics.median(v) for b, v in runs.items()}
    used = all(getattr(loop, "captured", False) for loop in loops.values()) if cuda else False
    overlap = [measure_overlap(nbytes, dev, captured, passes)
               for nbytes in OVERLAP_BYTES if nbytes <= max(byte_sizes)]
    return {"points": points, "cudagraphs": used, "compute": compute_constants(dev),
            "overlap": overlap}


OVERLAP_BYTES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
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


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """alpha, beta >= 0 minimising the squared relative error of alpha + beta * bytes."""
    # rows [1/m, b/m] . [alpha, beta] ~ 1: 2x2 normal equations
    s11 = sum(1 / m**2 for _, m in points)
    s12 = sum(b / m**2 for b, m in points)
    s22 = sum(b * b / m**2 for b, m in points)
    r1, r2 = sum(1 / m for _, m in points), sum(b / m for b, m in points)
    det = s11 * s22 - s12 * s12
    if len(points) < 2 or det <= 0:
        return statistics.median(m for _, m in points), 0.0
    alpha, beta = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if beta < 0:
        return statistics.median(m for _, m in points), 0.0
    if alpha < 0:  # through the origin
        return 0.0, r2 / s22
    return alpha, beta


def _minimax(points: list[tuple[int, float]], alpha: float, beta: float
             ) -> tuple[float, float]:
    """Refine a least-squares line to shrink its worst relative error: alternate 1-D searches
    on alpha and beta (the worst error is convex in each), keeping both >= 0."""
    worst = lambda a, b: max(abs(a + b * x - m) / m for x, m in points)  # noqa: E731

    def search(f, lo, hi):
        for _ in range(60):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            lo, hi = (lo, m2) if f(m1) <= f(m2) else (m1, hi)
        return (lo + hi) / 2

    top = max(m for _, m in points)
    for _ in range(4):
        alpha = search(lambda a: worst(a, beta), 0.0, 2 * top)
        span = max(beta * 4, top / max(x for x, _ in points))
        beta = search(lambda b: worst(alpha, b), 0.0, span)
    return alpha, beta


def _max_error(segments, points) -> float:
    return max(abs(_predict(segments, b) - m) / m for b, m in points)


def _predict(segments: list[dict], nbytes: int) -> float:
    seg = next((s for s in segments if nbytes <= s["up_to_bytes"]), segments[-1])
    return seg["alpha_us"] + seg["beta_us_per_byte"] * nbytes


def fit(points: dict[int, float], max_segments: int = 4) -> list[dict]:
    """Piecewise alpha-beta with the fewest segments whose worst relative error is under 10%
    (else the best of up to ``max_segments``); breakpoints at measured sizes. Candidate
    breakpoints are ranked by least squares; the best few are refined to minimax."""
    pts = sorted(points.items())

    def segs(cuts, refine=False):
        bounds = [0, *cuts, len(pts)]
        out = []
        for lo, hi in zip(bounds, bounds[1:]):
            a, b = _line(pts[lo:hi])
            if refine:
                a, b = _minimax(pts[lo:hi], a, b)
            out.append({"up_to_bytes": pts[hi - 1][0], "alpha_us": a, "beta_us_per_byte": b})
        return out

    best = segs([], refine=True)
    for k in range(1, max_segments):
        if _max_error(best, pts) < 0.10:
            break
        ranked = sorted(_cut_choices(len(pts), k), key=lambda c: _max_error(segs(c), pts))
        for cuts in ranked[:8]:
            cand = segs(list(cuts), refine=True)
            if _max_error(cand, pts) < _max_error(best, pts):
                best = cand
    return best


def _cut_choices(n: int, k: int, min_len: int = 3):
    """Increasing breakpoints leaving at least ``min_len`` points per segment."""
    import itertools

    for cuts in itertools.combinations(range(min_len, n - min_len + 1), k):
        if all(b - a >= min_len for a, b in zip(cuts, cuts[1:])):
            yield cuts


def profile(results: list[dict], *, backend: str, device: str, world: int,
            nccl_mode: str | None, command: str) -> dict:
    """The profile.json content: each size's slowest rank, the fits and their errors."""
    points = {b: max(r["points"][b] for r in results) for b in results[0]["points"]}
    segments = fit(points)
    alpha, beta = _line(sorted(points.items()))
    rows = [{"bytes": b, "measured_us": round(m, 2), "predicted_us": round(_predict(segments, b), 2),
             "error": round((_predict(segments, b) - m) / m, 4)} for b, m in sorted(points.items())]
    in_range = [r for r in rows if 1024 <= r["bytes"] <= 16 << 20]
    return {
        "backend": backend, "device": device, "world_size": world, "nccl_mode": nccl_mode,
        "alpha_us": round(alpha, 3), "beta_us_per_byte": beta, "segments": segments,
        "points": rows,
        "max_abs_error_1KB_16MB": max((abs(r["error"]) for r in in_range), default=math.nan),
        "cudagraphs": results[0]["cudagraphs"], "compute": results[0]["compute"],
        **overlap_summary(results),
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
    results = spawn(calibrate_worker, args.tp, (byte_sizes, args.device, cudagraphs, args.budget),
                    backend=backend, env=env)
    return profile(results, backend=backend, device=args.device, world=args.tp,
                   nccl_mode=args.nccl_mode if backend == "nccl" else None,
                   command=args.command_line)


def write_profile(data: dict, path: str) -> None:
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
