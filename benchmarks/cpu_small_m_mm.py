"""What a verify step costs on this CPU: small-M matmuls of SmolLM2-135M's shapes, one thread.

Greedy decoding multiplies one row by each weight; verifying a tree of N tokens multiplies N.
On a GPU (and for a memory-bound GEMV) N rows cost about one; here they do not (NOTES.md,
session 9). Three forms of the same product: ``F.linear(x, W)``, ``(W @ x.T).T`` and
``x @ W.T`` with W.T stored contiguous. Prints microseconds (median of 50 after 5 warm-ups).

    python benchmarks/cpu_small_m_mm.py
"""
import statistics

import torch
import torch.nn.functional as F

from fxcoalesce.apps.bench.timing import timed

SHAPES = ((1536, 576), (576, 1536), (49152, 576), (576, 576))
"""(out, in) of SmolLM2-135M's weights: MLP up/gate, MLP down, the LM head, attention."""


def median_us(f, n: int = 50) -> float:
    for _ in range(5):
        f()
    return statistics.median(timed(f, "cpu")[1] for _ in range(n))


def main() -> None:
    torch.set_num_threads(1)
    for out, inp in SHAPES:
        W = torch.randn(out, inp)
        Wt = W.t().contiguous()
        row = []
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, inp)
            lin = median_us(lambda: F.linear(x, W))
            w_xt = median_us(lambda: torch.mm(W, x.t()).t())
            x_wt = median_us(lambda: torch.mm(x, Wt))
            row.append(f"m={m}: lin {lin:.0f} W@xT {w_xt:.0f} x@Wt {x_wt:.0f}")
        print((out, inp), " | ".join(row))


if __name__ == "__main__":
    main()
