"""Predicted time: compute per graph node (a roofline) and communication per collective
(``CostModel``), and what of the communication the graph's order leaves exposed.

    hidden(c)  = e · min(T(c), compute between c's input and its first consumer)
    exposed(c) = T(c) - hidden(c)

with ``e`` the profile's overlap efficiency at c's size (1 unless ``calibrate`` measured it).

A prediction, not a measurement: the node order is the one the passes chose, and compute is a
roofline (``max(flops / peak, bytes / bandwidth)`` plus a launch cost for matmuls and
attention, which stay kernels of their own). ``fxcoalesce calibrate`` measures the constants.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.fx import Node

from .analysis import Analysis
from .collectives import WAIT, is_collective, op_of
from .config import CostModel
from .meta import hinted_nbytes, hinted_numel, size_hint, tensor_val

aten = torch.ops.aten

DEVICE_DEFAULTS = {  # (TFLOP/s, GB/s, µs per kernel): leads until a profile measures them
    "cpu": (0.1, 10.0, 5.0),
    "cuda": (400.0, 3000.0, 4.0),
}
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
ATTENTION = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(aten, name)}


@dataclass(frozen=True, slots=True)
class Roofline:
    peak_tflops: float
    memory_gbps: float
    kernel_us: float

    @classmethod
    def of(cls, cost: CostModel, device: str) -> Roofline:
        peak, mem, kern = DEVICE_DEFAULTS.get(device, DEVICE_DEFAULTS["cpu"])
        return cls(cost.peak_tflops or peak, cost.memory_gbps or mem,
                   kern if cost.kernel_us is None else cost.kernel_us)


def _flops(node: Node) -> int:
    vals = [tensor_val(a) for a in node.args if isinstance(a, Node)]
    out = tensor_val(node)
    if node.target in MATMULS and out is not None:
        a = vals[-2]  # mm(a, b), addmm(bias, a, b), bmm(a, b), baddbmm(c, a, b)
        return 2 * hinted_numel(out.shape) * size_hint(a.shape[-1])
    if node.target in ATTENTION and len(vals) >= 2:
        q, k = vals[0], vals[1]  # [B, H, S, D], [B, H, T, D]
        return 4 * hinted_numel(q.shape) * size_hint(k.shape[-2])
    return hinted_numel(out.shape) if out is not None else 0


_ESTIMATES: weakref.WeakKeyDictionary[Node, tuple[Roofline, float]] = (
    weakref.WeakKeyDictionary())
"""(roofline, µs) per node, so that each node is estimated once whatever reads it (the
passes' deciders, the report's before and after). Kept off the graph: the pipeline's input
graph is never written to, and an entry lives only as long as its node."""


def node_us(node: Node, roof: Roofline) -> float:
    """Roofline time of one node (0 for views, collectives, waits and non-tensor nodes)."""
    cached = _ESTIMATES.get(node)
    if cached is not None and cached[0] == roof:
        return cached[1]
    us = _node_us(node, roof)
    _ESTIMATES[node] = (roof, us)
    return us


def carry_estimates(nodes: dict[Node, Node]) -> None:
    """Give each copy the estimate of its original (``nodes``: original -> copy, a
    node-for-node copy sharing the originals' values), so none is estimated again."""
    for old, new in nodes.items():
        if (cached := _ESTIMATES.get(old)) is not None:
            _ESTIMATES[new] = cached


def _node_us(node: Node, roof: Roofline) -> float:
    out = tensor_val(node)
    if node.op != "call_function" or out is None or is_collective(node) or op_of(node) is WAIT:
        return 0.0
    if isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        return 0.0
    ins = [tensor_val(a) for a in node.all_input_nodes]
    nbytes = sum(hinted_nbytes(t) for t in [out, *ins] if t is not None)
    t = max(_flops(node) / (roof.peak_tflops * 1e6), nbytes / (roof.memory_gbps * 1e3))
    own_kernel = node.target in MATMULS or node.target in ATTENTION
    return t + (roof.kernel_us if own_kernel else 0.0)


def graph_device(analysis: Analysis) -> str:
    for info in analysis.infos:
        return info.block.key.device.split(":")[0]
    return "cpu"


def compute_prefix(analysis: Analysis, roof: Roofline) -> list[float]:
    """prefix[i] = predicted compute time of the nodes before position i. Kept with the
    analysis (``Analysis.memo``): every reader of one analysis gets the same list (do not
    modify it)."""
    key = ("prefix", roof)
    prefix = analysis.memo.get(key)
    if prefix is None:
        prefix = analysis.memo[key] = [
            0.0, *itertools.accumulate(node_us(n, roof) for n in analysis.order)]
    return prefix


def predict(analysis: Analysis, cost: CostModel, world: int) -> dict[str, float]:
    """Predicted all_reduce time of the graph: total, hidden under compute, exposed."""
    roof = Roofline.of(cost, graph_device(analysis))
    prefix = compute_prefix(analysis, roof)
    total = hidden = 0.0
    for info in analysis.infos:
        t = cost.all_reduce_us(info.block.nbytes, world)
        total += t
        hidden += cost.hidden_us(t, prefix[info.need] - prefix[info.ready + 1],
                                 info.block.nbytes)
    return {"total": round(total, 1), "hidden": round(hidden, 1),
            "exposed": round(total - hidden, 1)}


def part_us(node: Node, roof: Roofline, share: float, whole: set[Node]) -> float:
    """Roofline time of ``node`` run on ``share`` of its tokens (one part of a token split):
    its inputs in ``whole`` (weights) are read whole by every part, the rest scale."""
    out = tensor_val(node)
    if node.op != "call_function" or out is None or is_collective(node) or op_of(node) is WAIT:
        return 0.0
    if isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        return 0.0
    split = sum(hinted_nbytes(t) for t in [out, *(tensor_val(a) for a in node.all_input_nodes
                                                 if a not in whole)] if t is not None)
    kept = sum(hinted_nbytes(t) for t in (tensor_val(a) for a in node.all_input_nodes
                                          if a in whole) if t is not None)
    t = max(share * _flops(node) / (roof.peak_tflops * 1e6),
            (share * split + kept) / (roof.memory_gbps * 1e3))
    own_kernel = node.target in MATMULS or node.target in ATTENTION
    return t + (roof.kernel_us if own_kernel else 0.0)


def split_exposed_us(cost: CostModel, world: int, nbytes: int, shares: tuple[float, float],
                     windows: tuple[float, float]) -> float:
    """Predicted exposed time of one all_reduce of ``nbytes`` split in two parts of the token
    ``shares``, part i hidden by ``windows[i]`` µs of the other part's compute (part A's
    under B's compute before B's all_reduce, B's under A's compute after A's wait)."""
    exposed = 0.0
    for share, window in zip(shares, windows):
        part = int(nbytes * share)
        t = cost.all_reduce_us(part, world)
        exposed += t - cost.hidden_us(t, window, part)
    return exposed
