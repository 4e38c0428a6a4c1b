"""World size 1 on one GPU (issue 22 §1): ``nccl_symm`` (NCCL's all_reduce on a registered
window, ``fxcoalesce.kernels.nccl_symm``) against plain NCCL and torch's one-shot.

    python benchmarks/gpu_nccl_symm.py --part nccl --out DIR   # NCCL's symmetric backend
    python benchmarks/gpu_nccl_symm.py --part cuda --out DIR   # torch's CUDA backend

One process per part: torch's symmetric-memory backend is process-wide. ``nccl``: the backend
facts (the default, the switch, a switch back after an allocation), the readiness check and
prepare, exact sums (eager, and a CUDA graph replayed on new inputs), time per call in a
CUDA graph (CUDA events, 3 warm-up replays, median of 15 replays of 50 calls) of plain NCCL,
NCCL in place on the window (no copies), the op (copy in, NCCL, copy out) and the two copies
alone; then ``torch.compile(mode="reduce-overhead")`` through the backend with a profile in
which nccl_symm always wins, against ``Config(lower=False)``. ``cuda``: the same timing for
plain NCCL and ``symm_mem.one_shot_all_reduce``, and whether NCCL's backend can still be set
after a CUDA-backend allocation. Results: ``DIR/nccl_symm_<part>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SIZES = (1 << 10, 32 << 10, 128 << 10, 1 << 20)
"""Bytes of bf16 timed: decode-sized all_reduces up to 1 MiB."""
REPS, PASSES = 50, 15


def graph_us(call) -> float:
    """Median µs per call of ``call`` captured REPS times in one CUDA graph."""
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(REPS):
            call()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(PASSES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return round(statistics.median(times), 3)


def step(out: dict, name: str, fn) -> None:
    try:
        out[name] = fn()
    except Exception as e:  # every step records its failure and the run goes on
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                     "trace": traceback.format_exc()[-1500:]}
    print(name, json.dumps(out[name], default=str)[:600], flush=True)


def _backend():
    from torch.distributed import _symmetric_memory as sm

    try:
        return sm.get_backend(torch.device("cuda"))
    except Exception as e:
        return f"get_backend raised {type(e).__name__}: {e}"


def nccl_part(out: dict, group: str, dev: torch.device, tmp: Path) -> None:
    from fxcoalesce.kernels import nccl_symm

    op = torch.ops.fxcoalesce.nccl_symm_all_reduce
    step(out, "backend_before", _backend)
    step(out, "use_nccl_backend", lambda: list(nccl_symm.use_nccl_backend()))
    step(out, "backend_after", _backend)
    step(out, "ready", lambda: list(nccl_symm.ready(group)))
    step(out, "prepare_1MiB", lambda: list(nccl_symm.prepare(group, dev, 1 << 20)))

    def exact():
        res = {}
        for dtype in (torch.bfloat16, torch.float32):
            for shape in ((1, 7), (3, 4096), (16, 4096), (64, 8192)):
                x = torch.randn(shape, device=dev).to(dtype)
                y = op(x, group)
                res[f"{str(dtype)[6:]}{list(shape)}"] = bool(torch.equal(y, x)
                                                            and y.data_ptr() != x.data_ptr())
        return res
    step(out, "exact_eager", exact)

    def captured():
        x = torch.randn(16, 4096, device=dev).to(torch.bfloat16)
        op(x, group)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            y = op(x, group)
        ok = []
        for seed in range(3):
            x.copy_(torch.randn(16, 4096, device=dev, generator=torch.Generator(
                device=dev).manual_seed(seed)).to(torch.bfloat16))
            g.replay()
            torch.cuda.synchronize()
            ok.append(bool(torch.equal(y, x)))
        return {"replays_exact": ok}
    step(out, "cudagraph_replay", captured)

    def one_shot_on_window():  # does torch run its CUDA-backend kernel on an NCCL window?
        w = nccl_symm.get_workspace(group, dev, 1 << 20)[:8192].view(torch.bfloat16)
        w.copy_(torch.randn(4096, device=dev).to(torch.bfloat16))
        y = torch.ops.symm_mem.one_shot_all_reduce(w, "sum", group)
        return {"ran": True, "exact": bool(torch.equal(y, w))}
    step(out, "one_shot_on_nccl_window", one_shot_on_window)

    def timing():
        res = {}
        for nbytes in SIZES:
            n = nbytes // 2
            x = torch.zeros(n, dtype=torch.bfloat16, device=dev)
            win = nccl_symm.get_workspace(group, dev, nbytes)[:nbytes].view(torch.bfloat16)
            tmp_out = torch.empty_like(x)
            pg = dist.group.WORLD
            res[nbytes] = {
                "nccl_plain": graph_us(lambda: dist.all_reduce(x, group=pg)),
                "nccl_on_window": graph_us(lambda: dist.all_reduce(win, group=pg)),
                "nccl_symm_op": graph_us(lambda: op(x, group)),
                "two_copies": graph_us(lambda: (win.copy_(x), tmp_out.copy_(win))),
            }
        return res
    step(out, "graph_us_per_call", timing)
    step(out, "compile_reduce_overhead", lambda: compiled(group, dev, tmp))

    def switch_back():
        from torch.distributed import _symmetric_memory as sm

        sm.set_backend("CUDA")
        return {"set_backend_CUDA_after_allocation": "allowed", "now": _backend()}
    step(out, "switch_back_to_cuda", switch_back)


def forcing_profile(tmp: Path) -> Path:
    """World size 1: NCCL 1 ms, nccl_symm 0.1 µs: nccl_symm always wins (steering only)."""
    flat = lambda us: {"segments": [{"up_to_bytes": 1 << 30, "alpha_us": us,  # noqa: E731
                                     "beta_us_per_byte": 0.0}], "max_bytes": 1 << 30}
    data = {"backend": "nccl", "device": "cuda", "world_size": 1, "alpha_us": 1000.0,
            "beta_us_per_byte": 0.0, "segments": flat(1000.0)["segments"],
            "implementations": {"nccl_symm": flat(0.1)}, "symm_backend": {"backend": "NCCL"}}
    path = tmp / "force_nccl_symm.json"
    path.write_text(json.dumps(data))
    return path


def compiled(group: str, dev: torch.device, tmp: Path) -> dict:
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    import fxcoalesce

    torch.manual_seed(0)
    w1 = (torch.randn(4096, 4096, device=dev) / 64).to(torch.bfloat16)
    w2 = (torch.randn(4096, 4096, device=dev) / 64).to(torch.bfloat16)

    def fn(x):  # two row-parallel projections with their residual adds: a chain of two
        h = x + funcol.all_reduce(x @ w1, "sum", dist.group.WORLD)
        return h + funcol.all_reduce(torch.relu(h) @ w2, "sum", dist.group.WORLD)

    x = torch.randn(16, 4096, device=dev).to(torch.bfloat16)
    cfgs = {"nccl": fxcoalesce.Config(lower=False),
            "nccl_symm": fxcoalesce.Config(cost=fxcoalesce.CostModel.from_profile(
                forcing_profile(tmp)), disable=("fuse_norm",))}
    res = {}
    for name, cfg in cfgs.items():
        torch._dynamo.reset()
        counters.clear()
        fxcoalesce.clear_reports()
        f = torch.compile(fn, backend=fxcoalesce.backend(cfg, mode="reduce-overhead"))
        with torch.no_grad():
            y, codes = run_and_get_code(f, x)
            for _ in range(3):  # CUDA-graph trees: warm-up, record, replay
                y = f(x)
            torch.cuda.synchronize()
            times = []
            for _ in range(20):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                f(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            y = f(x).clone()
        code = "\n".join(codes)
        chosen = [d["chose"] for r in fxcoalesce.reports() for d in r.decisions
                  if d.get("pass") == "lower"]
        res[name] = {"out": y, "us_median": round(statistics.median(times), 2),
                     "lowered": {c: chosen.count(c) for c in set(chosen)},
                     "nccl_symm_calls_in_code": code.count("fxcoalesce.nccl_symm_all_reduce"),
                     "cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0),
                     "warnings": [w for r in fxcoalesce.reports() for w in r.warnings][:5]}
    same = bool(torch.equal(res["nccl"]["out"], res["nccl_symm"]["out"]))
    for r in res.values():
        del r["out"]
    return {**res, "outputs_equal": same}


def cuda_part(out: dict, group: str, dev: torch.device) -> None:
    from torch.distributed import _symmetric_memory as sm

    from fxcoalesce.kernels import symm

    step(out, "backend_before", _backend)
    step(out, "symm_mem_ready", lambda: list(symm.symm_mem_ready(group)))
    step(out, "backend_after_allocation", _backend)

    def timing():
        res = {}
        buf = sm.empty(max(SIZES) // 2, dtype=torch.bfloat16, device=dev)
        sm.rendezvous(buf, group)
        for nbytes in SIZES:
            n = nbytes // 2
            x = torch.zeros(n, dtype=torch.bfloat16, device=dev)
            view = buf[:n]
            res[nbytes] = {
                "nccl_plain": graph_us(lambda: dist.all_reduce(x, group=dist.group.WORLD)),
                "one_shot": graph_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(
                    view, "sum", group)),
                "one_shot_copy_in": graph_us(lambda: torch.ops.fxcoalesce.one_shot_all_reduce(
                    x, group)),
            }
        return res
    step(out, "graph_us_per_call", timing)

    def switch():
        sm.set_backend("NCCL")
        return {"set_backend_NCCL_after_CUDA_allocation": "allowed", "now": _backend()}
    step(out, "switch_to_nccl", switch)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("nccl", "cuda"), required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1,
                            device_id=dev)
    group = dist.group.WORLD.group_name
    out = {"part": args.part, "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "gpu": torch.cuda.get_device_name(), "world_size": 1,
           "command": "python " + " ".join(sys.argv), "reps_per_graph": REPS,
           "replays_timed": PASSES}
    tmp = Path(args.out)
    tmp.mkdir(parents=True, exist_ok=True)
    (nccl_part(out, group, dev, tmp) if args.part == "nccl" else cuda_part(out, group, dev))
    (tmp / f"nccl_symm_{args.part}.json").write_text(json.dumps(out, indent=2, default=str))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
