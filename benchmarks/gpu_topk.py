"""``topk`` against ``eagle3_static.topk_rows`` on the draft tree's shapes (k = 8 of a draft
vocabulary of 8192: the root's row and a depth's 8 rows; a depth's 64 children's scores),
log-softmaxed in float32 first, each run 20 times inside one CUDA graph, eager and compiled
(Inductor, default mode, then captured), medians of 21 replays (session 10, NOTES.md).

    python benchmarks/gpu_topk.py        # on a GPU
"""
import statistics

import torch

from fxcoalesce.models.eagle3_static import topk_rows

SHAPES = {"root (1, 8192)": (1, 8192), "depth (8, 8192)": (8, 8192), "children (64,)": (64,)}
REPS = 20


def graph_us(fn, x) -> float:
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn(x)
    times = []
    for _ in range(21):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return statistics.median(times)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    impls = {"topk": lambda x: x.log_softmax(-1).topk(8),
             "topk_rows": lambda x: topk_rows(x.log_softmax(-1), 8)}
    for name, shape in SHAPES.items():
        x = torch.randn(shape, device="cuda")
        row = []
        for impl, fn in impls.items():
            for mode, f in (("eager", fn), ("compiled", torch.compile(fn))):
                row.append(f"{impl} {mode} {graph_us(f, x):6.1f} us")
        print(f"{name:16s} " + " | ".join(row))


if __name__ == "__main__":
    main()
