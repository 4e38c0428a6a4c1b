"""bucket: fuse mutually independent, compatible all_reduces into one launch.

Requires: comm blocks from ``find_comm_blocks`` (all_reduce/all_reduce_ with one wait).
Ensures: every (key, level) group of the analysis becomes one all_reduce (split further
only by ``cfg.bucket_cap_mb``), issued right after its last member's input; consumers
read the same values as before. Launches after = lower bound when the cap allows. The
collectives come out in a rank-invariant issue order (``graph_order.issue_order``: a fused
one is keyed by its first member's place in the program's sequence). Symbolic sizes are
fine: split sizes and shapes are read back with ``sym_numel`` / ``sym_size``; the cap uses
size hints.

    before                                  after
    %a = all_reduce(%x, sum, 0)             %cat = cat([reshape(%x, [-1]), reshape(%y, [-1])])
    %wa = wait_tensor(%a)                   %ab = all_reduce(%cat, sum, 0)
    %b = all_reduce(%y, sum, 0)             %w = wait_tensor(%ab)
    %wb = wait_tensor(%b)                   %s = split_with_sizes(%w, [n_x, n_y])
    %out = add(%wa, %wb)                    %out = add(reshape(%s[0], x.shape), reshape(%s[1], y.shape))
"""

from __future__ import annotations

import operator
from collections import deque

import torch
from torch.fx import GraphModule, Node

from fxcoalesce.analysis import Analysis, BlockInfo, analyze
from fxcoalesce.collectives import ALL_REDUCE, WAIT
from fxcoalesce.config import Config
from fxcoalesce.graph_order import reorder
from fxcoalesce.meta import (ORIGIN, REPLACES, fake_mode_of, hinted_nbytes, origin, replaced,
                             storage_of)

from .decide import Decider
from .emit import Emitter, place
from .result import Bucket, PassResult
from fxcoalesce.checked import pinned_blocks

aten = torch.ops.aten


def plan_buckets(analysis: Analysis, cap_bytes: int, *, by_global_level: bool = False,
                 pinned=frozenset()) -> list[list[BlockInfo]]:
    """Group blocks by (key, level) in node order, splitting a group that exceeds the cap;
    ``pinned`` (``checked.pinned``) stays alone."""
    groups: dict[tuple, list[BlockInfo]] = {}
    for info in analysis.infos:
        if info.block.impl != "nccl" or info.block in pinned:  # lowered, or keeps its size
            continue
        lvl = info.global_level if by_global_level else info.level
        groups.setdefault((info.block.key, lvl), []).append(info)
    plan = []
    for members in groups.values():
        current, size = [], 0
        for m in members:
            if current and size + m.block.nbytes > cap_bytes:
                plan.append(current)
                current, size = [], 0
            current.append(m)
            size += m.block.nbytes
        plan.append(current)
    return plan


def quotient_is_acyclic(analysis: Analysis, plan: list[list[BlockInfo]]) -> bool:
    """Would merging each planned group's collectives into one node keep the graph a DAG?"""
    unit: dict[Node, int] = {}
    for gid, group in enumerate(plan):
        for info in group:
            unit[info.block.collective] = -1 - gid
    key = lambda n: unit.get(n, analysis.order[n])  # noqa: E731
    succ: dict[int, list[int]] = {}
    indeg: dict[int, int] = {}
    for n in analysis.order:
        u = key(n)
        indeg.setdefault(u, 0)
        for i in n.all_input_nodes:
            a = key(i)
            if a != u:
                succ.setdefault(a, []).append(u)
                indeg[u] += 1
    ready = deque(u for u, d in indeg.items() if d == 0)
    seen = 0
    while ready:
        u = ready.popleft()
        seen += 1
        for s in succ.get(u, ()):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return seen == len(indeg)


def _fuse(gm: GraphModule, group: list[BlockInfo], floor: Node | None, mode,
          priority: dict[Node, float], output_storages: set) -> Node:
    graph = gm.graph
    blocks = [i.block for i in group]
    # live inputs: a member may read the wait of a bucket fused just before, now replaced
    inputs = [b.collective.args[0] for b in blocks]
    anchor = max(inputs + ([floor] if floor is not None else []), key=priority.__getitem__)
    emit = Emitter(graph, after=anchor, mode=mode)
    flats = [emit(aten.reshape.default, x, [-1]) for x in inputs]
    # symbolic sizes are read off the member inputs: sym_size / sym_numel nodes
    shapes = [[s if isinstance(s, int) else emit(aten.sym_size.int, x, d)
               for d, s in enumerate(b.shape)] for x, b in zip(inputs, blocks)]
    numels = [emit(aten.sym_numel.default, x) if b.symbolic else b.numel
              for x, b in zip(inputs, blocks)]
    cat = emit(aten.cat.default, flats)
    key = blocks[0].key
    fused = emit(ALL_REDUCE, cat, key.op, blocks[0].group)
    fused.meta[REPLACES] = replaced(b.collective for b in blocks)
    fused.meta[ORIGIN] = f"cat({','.join(origin(b.collective) for b in blocks)})"
    wait = emit(WAIT, fused)
    parts = emit(aten.split_with_sizes.default, wait, numels)
    for i, (b, shape) in enumerate(zip(blocks, shapes)):
        out = emit(aten.reshape.default, emit(operator.getitem, parts, i), shape)
        if storage_of(b.wait) in output_storages:  # no new aliasing between graph outputs
            out = emit(aten.clone.default, out)
        b.wait.replace_all_uses_with(out)
        graph.erase_node(b.wait)
        graph.erase_node(b.collective)
    place(priority, emit.new, after=priority[anchor])
    return fused


def bucket_pass(gm: GraphModule, *, cfg: Config, pinned: frozenset = frozenset()
                ) -> PassResult:
    analysis = analyze(gm)
    result = PassResult()
    keep = pinned_blocks(analysis.scan, pinned)
    plan = plan_buckets(analysis, cfg.bucket_cap_bytes, pinned=keep)
    apart = [b for g in plan_buckets(analysis, cfg.bucket_cap_bytes) if len(g) > 1
             for b in (i.block for i in g) if b in keep]
    for b in apart:
        result.warnings.append(
            f"{b.collective.name} stays out of its bucket: a graph's first all_reduce (and "
            "any before it) carries the run-time check that peers run the same graph "
            "(Config.run_checks)")
    if len(analysis.chains) > 1 and not quotient_is_acyclic(analysis, plan):
        plan = plan_buckets(analysis, cfg.bucket_cap_bytes, by_global_level=True, pinned=keep)
        result.warnings.append(
            "per-key levels of different keys interlock; bucketed by global level instead "
            "(may miss the per-key bound)")
    decider = Decider.of(analysis, cfg)
    chosen = []
    for group in (g for g in plan if len(g) > 1):
        members, record = decider.choose(group, lambda sub: sum(m.block.nbytes for m in sub))
        result.decisions.append(record)
        if len(members) > 1:
            chosen.append(members)
    plan = chosen
    if not plan:
        return result
    mode = fake_mode_of(analysis.order)
    priority = {n: float(i) for n, i in analysis.order.items()}
    output_storages = {storage_of(n) for n in gm.graph.output_node().all_input_nodes} - {None}
    # a fused collective is issued where its first member was in the program's sequence
    issue_keys = {n: float(i) for i, n in enumerate(analysis.scan.sequence)}
    for group in plan:
        first = min(analysis.order[i.block.collective] for i in group)
        floor = max((b for b in analysis.barriers if analysis.order[b] < first),
                    key=analysis.order.__getitem__, default=None)
        fused = _fuse(gm, group, floor, mode, priority, output_storages)
        issue_keys[fused] = float(min(i.block.ordinal for i in group))
        result.buckets.append(Bucket(
            members=[i.block.collective.name for i in group],
            nbytes=hinted_nbytes(fused.meta["val"]),
            level=group[0].level, key=str(group[0].block.key), collective=fused.name))
    reorder(gm.graph, priority, set(analysis.barriers), issue_keys)
    result.changed = True
    return result
