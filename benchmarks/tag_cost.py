"""What the run-time check costs (issue 25): the tag an agreed graph's all_reduces carry
(``ranks.tag``) and the wrapper every call of such a graph goes through
(``runtime.Guarded``), measured side by side with the same graph untagged, in one run.

Variants, one compiled step each (a chain of ``--layers`` row-parallel layers, each
``h = rms_norm(h + all_reduce(h @ w))``, the sequential decoder's shape):

- ``plain``: the graph as Inductor gets it without fxcoalesce's tags (also what a graph of
  the program's own order costs: it carries no tag since issue 32);
- ``rewrite``: the first all_reduce tagged and the second made to wait for its check (a
  rewritten graph, with ``Config(run_checks=True)``, the default).

``--device cuda``: one GPU, NCCL at world size 1 (the collective kernels run; no peer),
``mode="reduce-overhead"`` (CUDA graphs), timed with CUDA events over ``--calls`` calls,
median of ``--repeat`` samples. ``--device cpu``: 2 gloo ranks, the slowest rank's step.
Also: the Python wrapper's cost per call, on the host.

    python benchmarks/tag_cost.py --device cuda --out $OUT/tag_cost_h200.json
    python benchmarks/tag_cost.py --device cpu --out benchmarks/results/tag_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

VARIANTS = ("plain", "rewrite")


def chain(layers: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    for w in layers:
        h = torch.nn.functional.rms_norm(h + funcol.all_reduce(h @ w, "sum", dist.group.WORLD),
                                         (h.shape[-1],))
    return h


def tag_pre_pass(variant: str, mismatch: bool = False):
    """An Inductor ``post_grad_custom_pre_pass`` tagging the graph as ``variant`` does;
    ``mismatch``: the tag sent is not a valid one (a pair of bits both set), so every check
    fails, as where a peer ran another graph (``--mismatch``)."""
    from fxcoalesce.ranks import tag

    def run(graph):
        if variant == "plain":
            return
        real = tag.bits
        if mismatch:
            tag.bits = lambda t: [1] + real(t)[1:tag.TAG_BITS] + [1] + real(t)[tag.TAG_BITS + 1:]
        try:
            tag.tag_pass(graph.owning_module, 1, world=lambda n: dist.get_world_size(),
                         where="bench")
        finally:
            tag.bits = real
    return run


def compiled(variant: str, mode: str | None, mismatch: bool = False):
    torch._dynamo.reset()
    options = {"post_grad_custom_pre_pass": tag_pre_pass(variant, mismatch)}
    if mode == "reduce-overhead":
        options["triton.cudagraphs"] = True
    return torch.compile(chain, options=options)


def time_cuda(fn, args, calls: int, repeat: int) -> list[float]:
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)  # µs a call
    return samples


def cuda_run(args) -> dict:
    import os

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    rows = []
    for dtype in (torch.bfloat16,):
        for tokens in args.tokens:
            g = torch.Generator(device="cuda").manual_seed(0)
            layers = [torch.randn(args.hidden, args.hidden, device="cuda", dtype=dtype,
                                  generator=g) / args.hidden ** 0.5 for _ in range(args.layers)]
            h = torch.randn(tokens, args.hidden, device="cuda", dtype=dtype, generator=g)
            outs, times = {}, {}
            names = VARIANTS
            for name in names:  # each compiled once, then sampled in turn
                outs[name] = compiled(name, "reduce-overhead")
            for _ in range(args.rounds):
                for name in names:
                    times.setdefault(name, []).extend(
                        time_cuda(outs[name], (layers, h), args.calls, 1))
            ref = outs["plain"](layers, h).clone()
            for variant in names:
                got = outs[variant](layers, h)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                             "hidden": args.hidden, "layers": args.layers,
                             "ar_bytes": tokens * args.hidden * h.element_size(),
                             "variant": variant,
                             "us_per_step_median": round(statistics.median(times[variant]), 2),
                             "us_per_step_p10": round(_q(times[variant], 0.1), 2),
                             "us_per_step_p90": round(_q(times[variant], 0.9), 2),
                             "equal_to_plain": bool(torch.equal(got, ref))})
    dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}


def cuda_mismatch(args) -> dict:
    """A check that fails on the GPU (a tag no rank could send, :func:`tag_pre_pass`), under
    CUDA graphs: the device-side assert must stop the process's CUDA work with the
    message."""
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29532", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    w = [torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)]
    h = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    f = compiled("rewrite", "reduce-overhead", mismatch=True)
    try:
        for _ in range(3):
            f(w, h)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the outcome is what is recorded
        return {"raised": type(e).__name__, "message": str(e)[:400]}
    return {"raised": None}


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _cpu_rank(rank, world, variant_list, hidden, tokens, layers, steps):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(hidden, hidden, generator=g) / hidden ** 0.5 for _ in range(layers)]
    h = torch.randn(tokens, hidden, generator=g)
    fns = {v: compiled(v, None) for v in variant_list}
    with torch.no_grad():
        for v in variant_list:
            for _ in range(10):
                fns[v](ws, h)
        times: dict[str, list[float]] = {v: [] for v in variant_list}
        for _ in range(steps):
            for v in variant_list:  # interleaved: the same load for every variant
                dist.barrier()
                t0 = time.perf_counter()
                fns[v](ws, h)
                times[v].append((time.perf_counter() - t0) * 1e6)
    return times


def cpu_run(args) -> dict:
    from fxcoalesce.apps.launch import spawn

    rows = []
    for tokens in args.tokens:
        res = spawn(_cpu_rank, 2, (VARIANTS, args.hidden, tokens, args.layers, args.steps),
                    backend="gloo", timeout=1800)
        for v in VARIANTS:
            slowest = [max(a, b) for a, b in zip(res[0][v], res[1][v])]
            rows.append({"tokens": tokens, "hidden": args.hidden, "layers": args.layers,
                         "ar_bytes": tokens * args.hidden * 4, "variant": v,
                         "us_per_step_median": round(statistics.median(slowest), 1),
                         "us_per_step_p10": round(_q(slowest, 0.1), 1),
                         "us_per_step_p90": round(_q(slowest, 0.9), 1)})
    return {"device": "cpu (2 gloo ranks, 2 shared cores)", "torch": torch.__version__,
            "rows": rows}


def wrapper_cost() -> dict:
    """µs the ``Guarded`` wrapper adds to one call (its check of the default group, its
    ``try``), against calling the same function directly: host time, any device."""
    from types import SimpleNamespace

    from fxcoalesce.ranks.runtime import Guarded

    def f(x):
        return x

    job = SimpleNamespace(cfg=None, name="bench", frame="", cut=None, guards=[])
    g = Guarded(f, [], job, None)
    n = 200_000
    out = {}
    for name, fn in (("direct", f), ("guarded", g)):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn(1)
            best.append((time.perf_counter() - t0) / n * 1e6)
        out[name] = round(min(best), 3)
    out["added_us"] = round(out["guarded"] - out["direct"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--mismatch", action="store_true",
                    help="on CUDA: make every check fail, and record how the process stops")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.mismatch:
        result = cuda_mismatch(args)
        print(json.dumps(result))
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1))
        return
    if args.device == "cuda":
        args.hidden = args.hidden or 7168
        args.tokens = args.tokens or [3, 16]  # 43 KB and 229 KB all_reduces in bf16
        result = cuda_run(args)
    else:
        args.hidden = args.hidden or 1024
        args.tokens = args.tokens or [4]
        result = cpu_run(args)
    result.update({"date": str(date.today()), "wrapper": wrapper_cost(),
                   "command": "python benchmarks/tag_cost.py " + " ".join(
                       f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                       for k, v in vars(args).items() if k != "out")})
    text = json.dumps(result, indent=1)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
