"""Experiment, not part of the tool: the report's predicted communication with each
all_reduce's "first consumer" found through Inductor-fusible chains (pointwise ops and
views), as Inductor fuses `x + attn` into a later add. Compare with the plain model and with
the GPU measurements in benchmarks/NOTES.md ("Predicted against measured gain").

    FXCOALESCE_PROFILE=benchmarks/results/gpu_h200x2_2026-11-30/calibrate_p2poff.json \
        python benchmarks/predict_fused_need.py fused|plain inspect --model falcon-40b \
        --layers 4 --tokens 16 --tp 2
"""
import sys, torch
import fxcoalesce.report as rep
from fxcoalesce import cost
from fxcoalesce.collectives import is_collective

def fusible(n):
    t = n.target
    if n.op != "call_function" or is_collective(n) or not isinstance(t, torch._ops.OpOverload):
        return False
    return t.is_view or torch.Tag.pointwise in t.tags

def need_fused(info, order, n_nodes):
    best, stack, seen = n_nodes, list(info.block.wait.users), set()
    while stack:
        u = stack.pop()
        if u in seen: continue
        seen.add(u)
        if fusible(u):
            stack.extend(u.users)
        else:
            best = min(best, order.get(u, n_nodes))
    return best

def predict2(analysis, cm, world):
    roof = cost.Roofline.of(cm, cost.graph_device(analysis))
    prefix = cost.compute_prefix(analysis, roof)
    order = {n: i for i, n in enumerate(analysis.order)}
    total = hidden = 0.0
    for info in analysis.infos:
        t = cm.all_reduce_us(info.block.nbytes, world)
        total += t
        need = need_fused(info, order, len(analysis.order))
        hidden += cm.hidden_us(t, prefix[need] - prefix[info.ready + 1])
    return {"total": round(total, 1), "hidden": round(hidden, 1), "exposed": round(total - hidden, 1)}

if sys.argv[1] == "fused":
    rep.predict = predict2
from fxcoalesce.apps.cli import main
sys.exit(main(sys.argv[2:]))
