"""GPU check of fxcoalesce.kernels on one GPU: an NCCL group of 1 rank in this process.

    python benchmarks/gpu_kernels.py --out gpu_kernels.json [--budget 270]

(from a checkout: it imports this checkout's fxcoalesce, which needs only torch and Triton)

Steps, each under a time limit, each printing one line and adding to the JSON at once:
  facts        torch/Triton/NCCL versions; whether symm_mem ops have fake/meta kernels
               (two_shot_all_reduce_ ...) before and after ensure_symm_mem_fakes(); whether
               torch._inductor.comm_lowering has register_symm_mem_lowerings and lowerings
               for one_shot / two_shot
  init         dist.init_process_group("nccl", world_size=1, device_id=cuda:0)
  ready        symm_mem_ready(world group)
  correctness  the op (Triton kernel) against the reference, bf16 and fp32, tokens 1/3/16/64 x
               hidden 576/4096/7168, with and without residual: max abs / rel errors
  cuda_graph   one call captured in a torch.cuda.CUDAGraph, replayed 100 times with new inputs
               (checked each time), a graph of two chained calls, signal pads back to zero
  timing       us per call inside a CUDA graph (100 calls per graph, median of 7 replays):
               the fused op, symm_mem.one_shot_all_reduce alone and followed by an add +
               rms_norm compiled by torch.compile, bf16 with residual, the same sizes
  timing_nccl  dist.all_reduce (NCCL) captured the same way, last: a hang here loses nothing
Exit status: 0 all passed, 1 a step failed, 2 no CUDA, 3 a step timed out (process ended).
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (shared machines), set first
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout, no install

EPS = 1e-5
TOKENS, HIDDEN = (1, 3, 16, 64), (576, 4096, 7168)
TOL = {torch.bfloat16: dict(rtol=2.0 ** -7, atol=1e-5), torch.float32: dict(rtol=1e-5,
                                                                           atol=1e-5)}


def _errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = (got.double() - want.double()).abs()
    rel = d / want.double().abs().clamp_min(1e-6)
    return {"max_abs": float(d.max()), "max_rel": float(rel.max()),
            "equal": bool(torch.equal(got, want))}


def step_facts(out: dict) -> str:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxcoalesce.kernels import fakes

    def traces(name):
        try:
            with FakeTensorMode():
                a = torch.empty(8, dtype=torch.bfloat16, device="cuda")
                args = (a, a) if "_copy" in name else (a,)
                args += ("sum", "0") + ((torch.empty_like(a),) if name.endswith("_out") else ())
                getattr(torch.ops.symm_mem, name).default(*args)
            return True
        except Exception as e:
            return f"{type(e).__name__}"

    names = [n for n in fakes.FAKES if hasattr(torch.ops.symm_mem, n)]
    nccl = torch.cuda.nccl.version()
    out["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                       "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                       "device": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    try:
        import triton
        out["versions"]["triton"] = triton.__version__
    except ImportError:
        out["versions"]["triton"] = None
    out["fake_before"] = {n: {"has_fake": fakes.has_fake(f"symm_mem::{n}"), "traces": traces(n)}
                          for n in names}
    out["fakes_registered"] = list(fakes.ensure_symm_mem_fakes())
    out["fake_after"] = {n: traces(n) for n in names}
    import torch._inductor.comm_lowering as cl
    from torch._inductor import lowering

    out["register_symm_mem_lowerings"] = hasattr(cl, "register_symm_mem_lowerings")
    if out["register_symm_mem_lowerings"]:
        try:
            cl.register_symm_mem_lowerings()
        except Exception as e:  # already registered, or other: recorded
            out["register_symm_mem_lowerings_call"] = f"{type(e).__name__}: {e}"
    ops = {"one_shot_all_reduce", "one_shot_all_reduce_copy", "two_shot_all_reduce_",
           "two_shot_all_reduce_out"}
    out["lowerings"] = {n: getattr(torch.ops.symm_mem, n).default in lowering.lowerings
                        for n in sorted(ops & set(names))}
    coll = getattr(torch._inductor.config, "_collective", None)
    out["auto_select"] = None if coll is None else getattr(coll, "auto_select", None)
    return (f"torch {torch.__version__}, triton {out['versions']['triton']}; two_shot fake "
            f"before: {out['fake_before'].get('two_shot_all_reduce_')}; lowerings "
            f"{out['lowerings']}")


def step_init(out: dict) -> str:
    from fxcoalesce.apps.launch import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0),
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    out["group_name"] = dist.group.WORLD.group_name
    return f"NCCL group of 1, name {out['group_name']!r}"


def step_ready(out: dict) -> str:
    from fxcoalesce.kernels import symm_mem_ready

    t = time.perf_counter()
    out["ok"], out["why"] = symm_mem_ready(dist.group.WORLD.group_name)
    out["seconds"] = round(time.perf_counter() - t, 3)
    if not out["ok"]:
        raise RuntimeError(out["why"])
    return f"{out['ok']} ({out['why']}) in {out['seconds']} s"


def _case(dtype, tokens, hidden, residual, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    r = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    return x, r, w


def step_correctness(out: dict) -> str:
    from fxcoalesce.kernels import ops

    name, rows, bad = dist.group.WORLD.group_name, [], 0
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in TOKENS:
            for hidden in HIDDEN:
                for residual in (True, False):
                    x, r, w = _case(dtype, tokens, hidden, residual)
                    before = ops.dispatch_counts["triton"]
                    normed, ro = torch.ops.fxcoalesce.all_reduce_add_rms_norm(x, r, w, EPS, name)
                    want_n, want_ro = ops.reference(x, r, w, EPS, name)
                    row = {"dtype": str(dtype), "tokens": tokens, "hidden": hidden,
                           "residual": residual,
                           "triton": ops.dispatch_counts["triton"] == before + 1,
                           "residual_out": _errors(ro, want_ro), "normed": _errors(normed, want_n)}
                    row["ok"] = (row["triton"] and row["residual_out"]["equal"]
                                 and torch.allclose(normed, want_n, **TOL[dtype]))
                    bad += not row["ok"]
                    rows.append(row)
    out["cases"] = rows
    worst = {k: max(r[k]["max_rel"] for r in rows) for k in ("residual_out", "normed")}
    if bad:
        raise RuntimeError(f"{bad} of {len(rows)} cases off (see cases); worst rel {worst}")
    return f"{len(rows)} cases ok; worst max rel err {worst}"


def step_cuda_graph(out: dict) -> str:
    from fxcoalesce.kernels import ops, symm

    name, op = dist.group.WORLD.group_name, torch.ops.fxcoalesce.all_reduce_add_rms_norm
    xs, rs, w = _case(torch.bfloat16, 16, 4096, True)
    op(xs, rs, w, EPS, name)  # warm: compiles, allocates the workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        normed, ro = op(xs, rs, w, EPS, name)
    wrong = 0
    for i in range(100):
        x, r, _ = _case(torch.bfloat16, 16, 4096, True, seed=i + 1)
        xs.copy_(x)
        rs.copy_(r)
        g.replay()
        want_n, want_ro = ops.reference(xs, rs, w, EPS, name)
        wrong += not (torch.equal(ro, want_ro) and torch.allclose(normed, want_n,
                                                                  **TOL[torch.bfloat16]))
    x2, _, w2 = _case(torch.float32, 3, 7168, False)
    op(x2, None, w2, EPS, name)
    torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):  # two calls back to back: the second reuses the workspace
        n1, ro1 = op(x2, None, w2, EPS, name)
        n2, ro2 = op(n1, ro1, w2, EPS, name)
    g2.replay()
    r1 = ops.reference(x2, None, w2, EPS, name)
    r2 = ops.reference(r1[0], r1[1], w2, EPS, name)
    # the second call's input is the first's normed, equal to the reference's to roundoff
    chained = all(torch.allclose(a, b, **TOL[torch.float32]) for a, b in zip((n2, ro2), r2))
    torch.cuda.synchronize()
    ws = symm._WORKSPACES[(name, 0)]
    slots = symm._signal_pad_bytes(ws.handle) // 4
    pad = ws.handle.get_signal_pad(ws.handle.rank, [slots], torch.int32)
    out.update(replays=100, wrong_replays=wrong, chained_ok=chained,
               signal_pad_nonzero=int(pad.count_nonzero()))
    if wrong or not chained or out["signal_pad_nonzero"]:
        raise RuntimeError(f"{wrong} wrong replays, chained ok {chained}, "
                           f"{out['signal_pad_nonzero']} signal slots left non-zero")
    return "100 replays right, chained calls right, signal pads all zero"


def _graph_us(fn, calls=100, replays=7) -> float:
    """Median us per call: a CUDA graph holding ``calls`` calls, replayed ``replays`` times
    after 3 warm-up replays, each timed with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del g
    return round(statistics.median(times), 2)


def step_timing(out: dict, deadline: float) -> str:
    import torch._dynamo
    from torch.distributed import _symmetric_memory as symm_mem

    name, op = dist.group.WORLD.group_name, torch.ops.fxcoalesce.all_reduce_add_rms_norm
    rows = out.setdefault("rows", [])
    for tokens in TOKENS:
        for hidden in HIDDEN:
            x, r, w = _case(torch.bfloat16, tokens, hidden, True)
            xsym = symm_mem.empty((tokens, hidden), dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(xsym, name)
            xsym.copy_(x)
            one_shot = torch.ops.symm_mem.one_shot_all_reduce
            row = {"tokens": tokens, "hidden": hidden,
                   "fused": _graph_us(lambda: op(x, r, w, EPS, name)),
                   "one_shot": _graph_us(lambda: one_shot(xsym, "sum", name))}
            if time.monotonic() < deadline - 30:  # Inductor compiles cost seconds each
                torch._dynamo.reset()
                norm = torch.compile(lambda y, r, w: F.rms_norm(y + r, (hidden,), w, EPS),
                                     dynamic=False)
                row["one_shot+add_rms_norm"] = _graph_us(
                    lambda: norm(one_shot(xsym, "sum", name), r, w))
            rows.append(row)
            print(f"  timing {row}", flush=True)
    return f"{len(rows)} sizes"


def step_timing_nccl(out: dict, rows: list) -> str:
    for row in rows:
        x = torch.randn(row["tokens"], row["hidden"], device="cuda").to(torch.bfloat16)
        row["nccl"] = _graph_us(lambda: dist.all_reduce(x))
        print(f"  nccl {row['tokens']}x{row['hidden']}: {row['nccl']} us", flush=True)
    return f"{len(rows)} sizes"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--budget", type=float, default=270.0, help="seconds for all steps")
    args = p.parse_args()
    results: dict = {"steps": {}}
    start = time.monotonic()
    deadline = start + args.budget

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)

    if not torch.cuda.is_available():
        results["error"] = "needs CUDA: torch sees no GPU"
        save()
        print(f"gpu_kernels: {results['error']}", flush=True)
        return 2

    def run(name, fn, limit):
        """Run one step in a thread; on a time-out, save and end the process (the GPU may be
        stuck in a kernel that never returns; nothing after it can be trusted)."""
        rec = results["steps"].setdefault(name, {})
        box = {}

        def body():
            try:
                box["line"] = fn(rec)
            except BaseException as e:
                box["error"] = f"{type(e).__name__}: {e}"
                rec["traceback"] = traceback.format_exc()[-3000:]

        t0 = time.monotonic()
        th = threading.Thread(target=body, daemon=True)
        th.start()
        th.join(max(1.0, min(limit, deadline - t0)))
        rec["seconds"] = round(time.monotonic() - t0, 2)
        if th.is_alive():
            rec.update(ok=False, error=f"timed out after {rec['seconds']} s")
            save()
            print(f"[TIMEOUT] {name}: {rec['error']}; results so far in {args.out}", flush=True)
            os._exit(3)
        rec["ok"] = "error" not in box
        rec["line"] = box.get("line") or box.get("error")
        save()
        print(f"[{'ok' if rec['ok'] else 'FAIL'}] {name} ({rec['seconds']} s): {rec['line']}",
              flush=True)
        return rec["ok"]

    run("facts", step_facts, 90)
    if run("init", step_init, 60) and run("ready", step_ready, 60):
        run("correctness", step_correctness, 120)
        run("cuda_graph", step_cuda_graph, 60)
        if run("timing", lambda rec: step_timing(rec, deadline), 150):
            run("timing_nccl", lambda rec: step_timing_nccl(
                rec, results["steps"]["timing"]["rows"]), 60)
    rows = results["steps"].get("timing", {}).get("rows", [])
    if rows:
        cols = ["fused", "one_shot", "one_shot+add_rms_norm", "nccl"]
        print("\nus per call inside a CUDA graph, bf16, world size 1")
        print(f"{'tokens':>6} {'hidden':>6} " + " ".join(f"{c:>22}" for c in cols))
        for row in rows:
            print(f"{row['tokens']:>6} {row['hidden']:>6} " + " ".join(
                f"{row.get(c, '-'):>22}" for c in cols))
    results["total_s"] = round(time.monotonic() - start, 1)
    save()
    ok = all(s.get("ok") for s in results["steps"].values())
    print(f"\n{'all steps passed' if ok else 'some steps FAILED'} in {results['total_s']} s; "
          f"{args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no destroy_process_group: with NCCL and CUDA graphs alive it can block
