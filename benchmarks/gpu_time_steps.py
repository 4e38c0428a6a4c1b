"""The tree sizing's step timing (``treechoice.time_steps``) on a small random target and draft:
the GPU path's CUDA-graph capture and replays, without the SmolLM2 GGUF (three device calls to
carry). Session 7 saw ``gpu_spec.sh tp1`` (H100, torch 2.11, bf16) fail there with a
device-side ``index_copy_(): index out of bounds`` at a candidate's replay in the timing loop,
after every candidate had been captured and replayed once; the CPU path passes. The cause:
the replay kept no reference to the step's state and pairs, which the graph reads at fixed
addresses (``treechoice._replayable``). Fixed; on an H100 in session 8 this passes
(benchmarks/results/gpu_h100x1_torch2.11_2026-12-06/gpu_time_steps.log).

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/gpu_time_steps.py cuda     # captured (the GPU path)
    python benchmarks/gpu_time_steps.py cuda --no-capture                # eager steps
    python benchmarks/gpu_time_steps.py cpu

Prints each shape set's timing, or the traceback (with CUDA_LAUNCH_BLOCKING=1, of the faulting
kernel's launch).
"""

import argparse
import traceback

import torch

from fxcoalesce.apps.spec import treechoice as tc
from fxcoalesce.models import eagle3 as e3
from fxcoalesce.models import llama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("device", choices=["cuda", "cpu"])
    ap.add_argument("--no-capture", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = llama.build(llama.TINY).to(dev, dtype)
    draft = e3.build_draft(e3.DraftArgs.for_target(target.args), seed=1).to(dev, dtype)
    room, draft_room, _ = tc.room_for_candidates()
    slots = -(-(40 + 256 + room) // 64) * 64  # spec_bench's cache: prompt + tokens + a tree
    target.setup_cache(1, slots)
    draft.setup_cache(slots + draft_room)
    for shapes in (tc.CANDIDATES[:1], tc.CANDIDATES):
        try:
            greedy, steps = tc.time_steps(target, draft, list(range(3, 40)), shapes,
                                          capture=not args.no_capture)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the point is to print it
            traceback.print_exc()
            return 1
        print(f"{len(shapes)} shape(s): greedy {greedy * 1e3:.3f} ms, "
              + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in steps.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
