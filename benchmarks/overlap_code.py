"""Collectives and the kernels they overlap, read from Inductor's generated code, for plain
torch.compile and fxcoalesce side by side (fake process group: compiles without peers).

    python benchmarks/overlap_code.py [--models neox-tiny kimi-k2-tiny:verify falcon-40b:forward:4]
                                      [--tp 2] [--tokens 8] [--out results/overlap_code.json]

For each model and variant: all_reduce launches in the code, and the kernels launched between
each all_reduce's issue and its wait (``fxcoalesce.apps.bench.code_overlap``), summed.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

import fxcoalesce
from fxcoalesce.apps.bench.code_overlap import collective_windows
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.apps.steps import make_step
from fxcoalesce.models import apply_tp, build

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = {
    "inductor": lambda: {"backend": "inductor"},
    "fxcoalesce": lambda: {"backend": fxcoalesce.backend()},
    "fxcoalesce (schedule only)": lambda: {
        "backend": fxcoalesce.backend(fxcoalesce.Config(passes=("schedule",)))},
}


def measure(name: str, step: str, layers: int | None, tp: int, tokens: int) -> dict:
    init_fake_group(tp)
    dtype = torch.bfloat16 if layers else torch.float32  # full-width models: bf16
    torch.manual_seed(0)
    model = apply_tp(build(name, layers=layers, dtype=dtype), dist.group.WORLD)
    fn, args = make_step(model, step, tokens)
    vocab = getattr(model.args, "vocab")
    args = (torch.randint(0, vocab, args[0].shape), *args[1:])
    row = {"model": name, "step": step, "layers": layers, "tp": tp, "tokens": tokens,
           "variants": {}}
    for variant, kwargs in VARIANTS.items():
        torch._dynamo.reset()
        with torch.no_grad():
            _, codes = run_and_get_code(torch.compile(fn, fullgraph=True, **kwargs()), *args)
        windows = [w for code in codes for w in collective_windows(code)
                   if w.op.startswith("all_reduce")]
        row["variants"][variant] = {"all_reduce_launches": len(windows),
                                    "overlapped_kernels": sum(w.kernels for w in windows),
                                    "per_collective": [w.kernels for w in windows]}
        print(f"{name:14s} {step:8s} {variant:28s} launches {len(windows):3d}  overlapped "
              f"kernels {sum(w.kernels for w in windows):3d}  {[w.kernels for w in windows]}",
              flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+",
                   default=["neox-tiny", "kimi-k2-tiny:verify", "falcon-40b:forward:4"],
                   help="NAME[:STEP[:LAYERS]]")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS / "overlap_code.json")
    args = p.parse_args()
    rows = []
    for spec in args.models:
        parts = spec.split(":")
        name, step, layers = parts[0], (parts[1:2] or ["forward"])[0], (parts[2:3] or [""])[0]
        rows.append(measure(name, step, int(layers) if layers else None, args.tp, args.tokens))
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
