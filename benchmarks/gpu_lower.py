"""World size 1 on one GPU (issue 15's one-H200 figures): every zoo model's step lowered and
compiled with ``mode="reduce-overhead"``, against the same step unlowered.

    python benchmarks/gpu_lower.py --out DIR [--models a,b] [--tokens 16] [--variants ...]
        [--eager-ref a,b] [--two-graphs a --tokens2 3]

An NCCL group of one rank keeps every all_reduce in the graph. Variants, each compiled behind
a backend of its own (dynamo never shares their code): ``nccl`` (``Config(lower=False)``),
``one_shot`` (a profile in which one-shot always wins, ``fuse_norm`` off) and ``fused``
(a profile in which the fused all_reduce + add + RMSNorm kernel always wins). The forcing
profiles only steer the choice: the point is that every lowered graph computes what the
unlowered one does. Per model and variant: the all_reduces the report lowered, outputs
against ``nccl`` (one-shot at world size 1 is exact up to the kernels' own fusion; the fused
kernel within bf16 rounding), the generated code (FileCheck: the symmetric-memory calls, the
P2P buffers, no more Triton kernels than unlowered: no copy into a P2P buffer), Inductor's
CUDA-graph skips (0: replayed under CUDA graphs) and the median step time (CUDA events).
Results: ``DIR/gpu_lower.json``; a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODELS = {  # name: (step, layers): full width, few layers, so every model fits one GPU
    "llama-3-8b": ("verify", 3), "smollm2-135m": ("verify", None), "llama-tiny": ("forward", None),
    "neox-tiny": ("forward", None), "falcon-40b": ("forward", 2), "llama-3-70b": ("forward", 2),
    "kimi-k2-tiny": ("verify", None), "deepseek-v3": ("verify", 4), "kimi-k2": ("verify", 3),
}


def forcing_profile(directory: Path, impl: str) -> Path:
    """A world-size-1 profile in which ``impl`` always wins (NCCL 1 ms, ``impl`` 0.1 µs)."""
    flat = lambda us: {"segments": [{"up_to_bytes": 1 << 30, "alpha_us": us,  # noqa: E731
                                     "beta_us_per_byte": 0.0}], "max_bytes": 1 << 30}
    impls = {"one_shot": flat(0.1)} if impl == "one_shot" else {
        "one_shot": flat(500.0), "fused_add_rms_norm": flat(0.1)}
    data = {"backend": "nccl", "device": "cuda", "world_size": 1, "alpha_us": 1000.0,
            "beta_us_per_byte": 0.0, "segments": flat(1000.0)["segments"],
            "implementations": impls}
    path = directory / f"force_{impl}.json"
    path.write_text(json.dumps(data))
    return path


def step_of(name: str, step: str, layers, tokens: int, group):
    from fxcoalesce import models
    from fxcoalesce.apps.steps import make_step

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = models.build(name, dtype=torch.bfloat16, layers=layers)
    models.apply_tp(model, group, keep_collectives=True)  # one rank: keep the all_reduces
    model.cuda()
    with torch.device("cuda"):
        fn, args = make_step(model, step, tokens)
    return fn, [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


def median_ms(fn, args, calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


VARIANTS = ("nccl", "one_shot", "fused", "one_shot_zc", "nccl_nocg", "one_shot_nocg")
"""``_nocg``: without CUDA graphs, where Inductor places the one-shot's input in a P2P buffer
itself (zero-copy); the others under ``mode="reduce-overhead"``. ``one_shot_zc``: the
zero-copy one-shot forced under CUDA graphs too (symmetric memory prepared at compile time),
to test whether torch's CUDA-graph trees replay it (``lowering.CUDAGRAPH_P2P``)."""


def run_variant(fn, args, variant: str, profiles: dict) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    import fxcoalesce

    base = variant.removesuffix("_nocg").removesuffix("_zc")
    cfg = {"nccl": fxcoalesce.Config(lower=False),
           "one_shot": fxcoalesce.Config(cost=fxcoalesce.CostModel.from_profile(
               profiles["one_shot"]), disable=("fuse_norm",)),
           "fused": fxcoalesce.Config(cost=fxcoalesce.CostModel.from_profile(profiles["fused"]))
           }[base]
    mode = None if variant.endswith("_nocg") else "reduce-overhead"
    torch._dynamo.reset()
    counters.clear()
    fxcoalesce.clear_reports()
    compiled = torch.compile(fn, backend=fxcoalesce.backend(cfg, mode=mode))
    t0 = time.perf_counter()
    import fxcoalesce.passes.lower as lower_module

    real = lower_module.under_cudagraphs
    if variant == "one_shot_zc":  # the lower pass emits Inductor's zero-copy one-shot
        lower_module.under_cudagraphs = lambda: False
    try:  # the zero-copy code is not what a cache keyed on the Config would serve
        with torch.no_grad(), (torch._inductor.config.patch(force_disable_caches=True)
                               if variant == "one_shot_zc" else contextlib.nullcontext()):
            out, codes = run_and_get_code(compiled, *args)
    finally:
        lower_module.under_cudagraphs = real
    with torch.no_grad():
        for _ in range(3):  # CUDA-graph trees: warm-up, record, replay
            out = compiled(*args)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        ms = median_ms(compiled, args)
        out = compiled(*args).clone()
    code = "\n".join(codes)
    chosen = [d["chose"] for r in fxcoalesce.reports() for d in r.decisions
              if d.get("pass") in ("lower", "fuse_norm")]
    return {"out": out, "code": code, "ms": round(ms, 4), "compile_s": round(compile_s, 1),
            "lowered": {c: chosen.count(c) for c in set(chosen)},
            "one_shot_calls": (code.count("symm_mem.one_shot_all_reduce")
                               + code.count("fxcoalesce.one_shot_all_reduce")),
            "fused_calls": code.count("fxcoalesce.all_reduce_add_rms_norm"),
            "p2p_buffers": len(re.findall(r"empty_strided_p2p\(", code)),
            "triton_launches": len(re.findall(r"\.run\(", code)),
            "cudagraph_skips": sum(counters["inductor"].get(k, 0) for k in
                                   ("cudagraph_skips",)),
            "warnings": [w for r in fxcoalesce.reports() for w in r.warnings][:5]}


def check_code(code: str, rec: dict, base: dict, variant: str) -> list[str]:
    """What the generated code must hold; each failed check as a sentence."""
    from torch.testing import FileCheck

    checks = {
        # under CUDA graphs the one-shot runs on a copy in the workspace (lowering.CUDAGRAPH_P2P)
        "one_shot": lambda: FileCheck().check("fxcoalesce.one_shot_all_reduce").run(code),
        # without: a P2P buffer is allocated, the producer writes into it, the one-shot reads it
        "one_shot_zc": lambda: FileCheck().check("empty_strided_p2p(").check(
            "symm_mem.one_shot_all_reduce").run(code),
        "one_shot_nocg": lambda: FileCheck().check("empty_strided_p2p(").check(
            "symm_mem.one_shot_all_reduce").run(code),
        # the fused all_reduce + add + RMSNorm is one call in the wrapper
        "fused": lambda: FileCheck().check("fxcoalesce.all_reduce_add_rms_norm").run(code),
    }
    problems = []
    try:
        checks[variant]()
    except RuntimeError as e:
        problems.append(f"FileCheck: {str(e).splitlines()[0]}")
    if rec["triton_launches"] > base["triton_launches"]:  # a copy kernel into a P2P buffer
        problems.append(f"{rec['triton_launches']} Triton launches, unlowered "
                        f"{base['triton_launches']}")
    return problems


def diffs(out, ref) -> dict:
    """How far ``out`` is from ``ref``: the largest difference, absolute and relative to the
    largest value, and the share of rows (tokens) off by more than 5% of the largest value
    (a routed expert chosen differently changes whole tokens, rounding changes all a little)."""
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max()
    rows = diff.reshape(-1, diff.shape[-1]).amax(dim=-1)
    return {"max_abs_diff": float(diff.max()), "max_rel_diff": float(diff.max() / scale),
            "rows_off_5pct": round(float((rows > 0.05 * scale).float().mean()), 4)}


def two_graphs(name: str, tokens: tuple[int, int], group, profiles: dict) -> dict:
    """Two graphs of one model (two token counts) lowered to Inductor's zero-copy one-shot in
    one process, without CUDA graphs: first with ``lowering.distinct_p2p_ids`` switched off
    (the control: torch's own alloc_ids collide), then with it; the second graph's output
    against the unlowered graph's at the same token count."""
    import fxcoalesce.passes.lower as lower_module

    step, layers = MODELS[name]
    (fn1, in1), (fn2, in2) = (step_of(name, step, layers, t, group) for t in tokens)
    rec = {"tokens": list(tokens)}
    real = lower_module.distinct_p2p_ids
    lower_module.distinct_p2p_ids = lambda key: None
    try:  # no cache: the seeded compile below must not be served the control's code
        with torch._inductor.config.patch(force_disable_caches=True):
            for t, fn, inputs in ((tokens[0], fn1, in1), (tokens[1], fn2, in2)):
                try:
                    run_variant(fn, inputs, "one_shot_nocg", profiles)
                    rec[f"unseeded_t{t}"] = "ran"
                except Exception as e:
                    rec[f"unseeded_t{t}"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        lower_module.distinct_p2p_ids = real
    ref = run_variant(fn2, in2, "nccl_nocg", profiles)["out"]
    for t, fn, inputs in ((tokens[0], fn1, in1), (tokens[1], fn2, in2)):
        try:
            r = run_variant(fn, inputs, "one_shot_nocg", profiles)
            rec[f"seeded_t{t}"] = {"ran": True, "lowered": r["lowered"],
                                   "p2p_buffers": r["p2p_buffers"]}
            if fn is fn2:
                rec[f"seeded_t{t}"].update(diffs(r["out"], ref))
        except Exception as e:
            rec[f"seeded_t{t}"] = f"{type(e).__name__}: {e}"[:300]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--cg-history", action="store_true",
                    help="CUDA-graph trees record allocation origins (for a leak report)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--nocg-models", default="kimi-k2-tiny,llama-3-8b",
                    help="models also compiled without CUDA graphs (the zero-copy one-shot)")
    ap.add_argument("--eager-ref", default="",
                    help="models whose outputs are also compared with the eager step's "
                    "(how far plain torch.compile itself moves them)")
    ap.add_argument("--two-graphs", default="",
                    help="models compiled at two token counts in one process, zero-copy "
                    "one-shot without CUDA graphs (lowering.distinct_p2p_ids, and without)")
    ap.add_argument("--tokens2", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_lower.py needs CUDA", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cg_history:
        torch._inductor.config.triton.cudagraph_trees_history_recording = True
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    tmp = Path(tempfile.mkdtemp())
    profiles = {"one_shot": forcing_profile(tmp, "one_shot"),
                "fused": forcing_profile(tmp, "fused")}
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "models": {}}
    for name in args.models.split(","):
        step, layers = MODELS[name]
        rec = results["models"][name] = {"step": step, "layers": layers}
        try:
            fn, inputs = step_of(name, step, layers, args.tokens, group)
            eager = None
            if name in args.eager_ref.split(","):
                with torch.no_grad():
                    eager = fn(*inputs).clone()
            base = {}
            nocg = name in args.nocg_models.split(",")
            wanted = [v for v in args.variants.split(",") if nocg or not v.endswith("_nocg")]
            for variant in [v for v in VARIANTS if v in wanted]:
                try:
                    r = run_variant(fn, inputs, variant, profiles)
                except Exception as e:  # one variant failing must not hide the others
                    rec[variant] = {"error": f"{type(e).__name__}: {e}"[:600],
                                    "traceback": traceback.format_exc()[-2000:]}
                    print(f"{name} {variant}: {rec[variant]['error']}", flush=True)
                    continue
                out, code = r.pop("out"), r.pop("code")
                if eager is not None:
                    r["against_eager"] = diffs(out, eager)
                ref = "nccl_nocg" if variant.endswith("_nocg") else "nccl"
                if variant == ref:
                    base[ref] = (r, out)
                elif ref in base:
                    b, base_out = base[ref]
                    r.update(diffs(out, base_out))
                    r["problems"] = check_code(code, r, b, variant)
                rec[variant] = r
                print(f"{name} {variant}: {json.dumps(r)}", flush=True)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:600]
            print(f"{name}: {rec['error']}", flush=True)
        (args.out / "gpu_lower.json").write_text(json.dumps(results, indent=2))
    for name in filter(None, args.two_graphs.split(",")):
        try:
            rec = results.setdefault("two_graphs", {})[name] = two_graphs(
                name, (args.tokens, args.tokens2), group, profiles)
        except Exception as e:
            rec = results.setdefault("two_graphs", {})[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
        print(f"{name} two graphs: {json.dumps(rec)}", flush=True)
        (args.out / "gpu_lower.json").write_text(json.dumps(results, indent=2))
    print("| model | variant | lowered | ms | max abs diff | skips | problems |")
    print("|---|---|---|---|---|---|---|")
    for name, rec in results["models"].items():
        for v in VARIANTS:
            if v not in rec:
                continue
            r = rec[v]
            print(f"| {name} | {v} | {r.get('lowered', r.get('error', '-'))} | {r.get('ms')} | "
                  f"{r.get('max_abs_diff', '')} | {r.get('cudagraph_skips', '')} | "
                  f"{r.get('problems', '')} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
