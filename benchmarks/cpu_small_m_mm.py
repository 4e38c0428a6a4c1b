"""What a verify step costs on this CPU: small-M matmuls of SmolLM2-135M's shapes, one thread.

Greedy decoding multiplies one row by each weight; verifying a tree of N tokens multiplies N.
On a GPU (and for a memory-bound GEMV) N rows cost about one; here they do not (NOTES.md,
session 9). Three forms of the same product: ``F.linear(x, W)``, ``(W @ x.T).T`` and
``x @ W.T`` with W.T stored contiguous. Prints microseconds (median of 50 after 5 warm-ups).

    python benchmarks/cpu_small_m_mm.py
"""
import torch, time, statistics
torch.set_num_threads(1)
def bench(f, n=50):
    for _ in range(5): f()
    ts=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); ts.append(time.perf_counter()-t0)
    return statistics.median(ts)*1e6
for (o,i) in [(1536,576),(576,1536),(49152,576),(576,576)]:
    W=torch.randn(o,i)
    Wt=W.t().contiguous()
    row=[]
    for m in (1,2,4,8,16):
        x=torch.randn(m,i)
        a=bench(lambda: torch.nn.functional.linear(x,W))
        b=bench(lambda: torch.mm(W,x.t()).t())
        c=bench(lambda: torch.mm(x,Wt))
        row.append(f"m={m}: lin {a:.0f} W@xT {b:.0f} x@Wt {c:.0f}")
    print((o,i), " | ".join(row))
