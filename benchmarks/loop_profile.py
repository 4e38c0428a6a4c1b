"""Where the decode loop's time goes past the GPU's: SmolLM2-135M and a head at TP 1, both
steps compiled as ``spec_bench.py`` compiles them (the fxcoalesce backend; on CUDA mode
"reduce-overhead": CUDA graphs), decoded greedily and speculatively with launch ahead off and
on. Per decoding, medians of ``--runs``:

- loop ms a step: from the first step's call to the last token read, over the calls made;
- host ms in the call: the Python time inside the compiled step's call (Dynamo's guards,
  the CUDA-graph tree's bookkeeping and input copies, the launch);
- GPU ms a step: the device time torch.profiler records over one more decoding, per call;
- the step alone: the compiled step called and synchronized (``treechoice.time_steps``).

Loop well above GPU: the host is the bound; loop near GPU but GPU above the step alone: work
in the loop the step's own timing leaves out. Then torch.profiler's top host ops of the
speculative loop (ahead on). Session 15 (benchmarks/NOTES.md) found ~0.5 ms a step
unattributed.

    python benchmarks/loop_profile.py --device cuda --random-weights --tree 8,6,64 --out F
    python benchmarks/loop_profile.py --random-weights --tree 1,1,2 --tokens 8 --codegen eager
"""
import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from step_profile import common_args, load

from fxcoalesce.apps.spec import treechoice as tc
from fxcoalesce.compiler import backend
from fxcoalesce.config import Config
from fxcoalesce.models import eagle3_static as es


class Watched:
    """A step function that counts its calls, their host time and when the first began."""

    def __init__(self, fn):
        self.fn, self.calls, self.host_s, self.first = fn, 0, 0.0, None

    def __call__(self, *args):
        t0 = time.perf_counter()
        self.first = self.first or t0
        out = self.fn(*args)
        self.calls += 1
        self.host_s += time.perf_counter() - t0
        return out


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def device_us(prof) -> float:
    """The device time the profiler recorded (kernels, copies), microseconds."""
    events = prof.key_averages()
    name = ("self_device_time_total" if hasattr(events[0], "self_device_time_total")
            else "self_cuda_time_total")
    return sum(getattr(e, name) for e in events)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a decoding")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args()
    target, draft, ids, dev, dtype = load(args)
    shape = tuple(int(x) for x in args.tree.split(","))
    spec = es.TreeSpec(top_k=shape[0], depth=shape[1], total_tokens=shape[2])
    room, draft_room, past = tc.room_for_candidates(shape)
    T = -(-(len(ids) + args.tokens + room + past) // 64) * 64  # as spec_bench sizes it
    target.setup_cache(1, T)
    draft.setup_cache(T + draft_room)
    cuda = dev.type == "cuda"
    settings = {"mode": "reduce-overhead"} if cuda else {}
    fns = {name: torch.compile(f, backend=backend(Config(codegen=args.codegen), **settings),
                               fullgraph=True)
           for name, f in (("greedy", es.decode_step), ("spec", es.spec_step))}
    prompt = torch.tensor(ids, device=dev)
    print(f"{dev} {dtype}, tree {args.tree}, cache {T}, prompt {len(ids)}, {args.tokens} "
          f"tokens, codegen {args.codegen}{', CUDA graphs' if cuda else ''}", flush=True)

    def decode(kind: str, ahead: bool, step: Watched):
        if kind == "greedy":
            return es.greedy_generate_static(target, prompt, args.tokens, step_fn=step,
                                             ahead=ahead)
        return es.speculative_generate_static(target, draft, prompt, args.tokens, spec=spec,
                                              step_fn=step, ahead=ahead)

    def once(kind: str, ahead: bool) -> tuple[float, float, int]:
        step = Watched(fns[kind])
        sync(dev)
        decode(kind, ahead, step)
        sync(dev)
        return (time.perf_counter() - step.first) / step.calls, step.host_s / step.calls, \
            step.calls

    t0 = time.perf_counter()
    for kind in ("greedy", "spec"):  # compile, record the CUDA graphs
        once(kind, False)
        once(kind, True)
    print(f"compiled and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    greedy_s, step_s = tc.time_steps(target, draft, ids, [spec], greedy_fn=fns["greedy"],
                                     step_fn=fns["spec"], capture=False, reps=args.runs)
    alone = {"greedy": greedy_s, "spec": step_s[tc.key_of(shape)]}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows, table = [], ""
    for kind in ("greedy", "spec"):
        for ahead in (False, True):
            got = [once(kind, ahead) for _ in range(args.runs)]
            with profile(activities=activities) as prof:
                _, _, calls = once(kind, ahead)
            gpu = device_us(prof) / 1e3 / calls if cuda else None
            row = {"decoding": kind, "ahead": ahead, "calls": calls,
                   "loop_ms": round(statistics.median(g[0] for g in got) * 1e3, 3),
                   "host_in_call_ms": round(statistics.median(g[1] for g in got) * 1e3, 3),
                   "gpu_ms": None if gpu is None else round(gpu, 3),
                   "alone_ms": round(alone[kind] * 1e3, 3)}
            rows.append(row)
            print(f"{kind:6} ahead {'on ' if ahead else 'off'}: loop {row['loop_ms']:.3f} ms a "
                  f"step, host in the call {row['host_in_call_ms']:.3f}, GPU {row['gpu_ms']}, "
                  f"the step alone {row['alone_ms']:.3f} ({calls} calls)", flush=True)
            if kind == "spec" and ahead:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                                  max_name_column_width=100)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                       "torch": torch.__version__, "tree": args.tree, "tokens": args.tokens,
                       "runs": args.runs, "random_weights": args.random_weights,
                       "codegen": args.codegen, "rows": rows, "top_host_ops": table}, f,
                      indent=1)


if __name__ == "__main__":
    main()
