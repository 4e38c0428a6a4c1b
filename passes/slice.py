"""slice: reduce only what is used, when an all_reduce's result is only read through a slice.

Requires: nothing (exact for every reduce op: reduction is elementwise across ranks).
Ensures: an all_reduce whose wait has a single user that slices it with integer arguments
(``slice``, ``select``; ``narrow`` and basic indexing lower to these), directly or through
layout-only ops that nothing else reads (``passes.layout``: view, reshape, ...), reduces the
sliced part of its input instead, put through the same layout ops: the bytes drop by the
slice ratio. Last-token logits after a reduction are the typical case. Graph outputs keep
their strides: one that the rewrite made dense (a strided view of the reduced tensor, or an
elementwise op of one) is copied back into its old layout (``layout.keep_output_strides``:
one write of its elements, as plain torch.compile returns it; storage offsets are not kept);
a block whose value reaches an output whose elements overlap other than along expanded
dims (``unfold``) is left alone.

    before                                    after
    %w = wait(all_reduce(%x, sum, 0))         %xs = select(reshape(%x, [1, 6, 64]), 1, -1)
    %v = view(%w, [1, 6, 64])                 %y  = wait(all_reduce(clone(%xs), sum, 0))
    %y = select(%v, 1, -1)                    %o  = copy(empty_strided([1, 64], [384, 1]), %y)
    return %y                                 return %o

A slice whose arguments differ between ranks (``AR(x).chunk(world)[rank]``) would make this
wrong, and one rank's graph cannot tell. So the new collective records its slice, which
becomes part of the issue sequence the backend compares across ranks at compile time
(``ranks.check``); on any difference every rank recompiles without this pass. Index tensors
(``index``, ``gather``) are left alone: their values could differ between ranks unseen.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_leaves

from fxcoalesce.analysis import analyze
from fxcoalesce.collectives import ALL_REDUCE, WAIT, op_name
from fxcoalesce.config import Config
from fxcoalesce.meta import (ORIGIN, REPLACES, SLICED, fake_mode_of, hinted_nbytes, origin,
                             replaced, tensor_val)

from .emit import Emitter
from .layout import (keep_output_strides, layout_chain, output_strides, refresh_vals, replay,
                     restorable)
from .result import Bucket, PassResult
from fxcoalesce.checked import pinned_blocks

aten = torch.ops.aten
SLICES = {aten.slice.Tensor, aten.select.int}


def _int_slice(node: Node) -> bool:
    return (node.op == "call_function" and node.target in SLICES and not node.kwargs
            and all(isinstance(a, int) or a is None for a in node.args[1:]))


def _reaches(node: Node, targets: set[Node]) -> bool:
    """Does ``node``'s value flow into one of ``targets``?"""
    seen, todo = set(), [node]
    while todo and targets:
        n = todo.pop()
        if n in targets:
            return True
        todo += [u for u in n.users if u not in seen]
        seen.update(n.users)
    return False


def slice_pass(gm: GraphModule, *, cfg: Config, pinned: frozenset = frozenset()
               ) -> PassResult:
    result = PassResult()
    analysis = analyze(gm)
    graph = gm.graph
    mode = fake_mode_of(analysis.order)
    strides = output_strides(graph)
    (out,) = graph.find_nodes(op="output")
    fixed = {leaf for leaf, st in zip(tree_leaves(out.args), strides, strict=True)
             if st is not None and not restorable(tensor_val(leaf).shape, st)}
    keep = pinned_blocks(analysis.scan, pinned)
    for block in analysis.scan.blocks:
        chain = layout_chain(block.wait, analysis.order)
        users = list(chain.end.users)
        if block.impl != "nccl" or block.inplace or len(users) != 1 or block in keep:
            continue
        (use,) = users
        if not _int_slice(use) or use.args[0] is not chain.end or _reaches(use, fixed):
            continue
        emit = Emitter(graph, before=block.collective, mode=mode)
        part = emit(use.target, replay(emit, block.input, chain), *use.args[1:])
        dense = emit(aten.clone.default, part, memory_format=torch.contiguous_format)
        fused = emit(ALL_REDUCE, dense, block.key.op, block.group)
        wait = emit(WAIT, fused)
        fused.meta[REPLACES] = replaced([block.collective])
        fused.meta[SLICED] = f"{op_name(use)}{tuple(use.args[1:])}"
        fused.meta[ORIGIN] = f"{fused.meta[SLICED]}({origin(block.collective)})"
        use.replace_all_uses_with(wait)
        for n in (use, *reversed(chain.ops), block.wait, block.collective):
            graph.erase_node(n)
        refresh_vals(wait, mode)  # what read the strided slice now reads a dense tensor
        result.buckets.append(Bucket(members=[block.collective.name],
                                     nbytes=hinted_nbytes(fused.meta["val"]),
                                     level=0, key=str(block.key), collective=fused.name,
                                     kind="slice"))
        # the slice is a local guess about rank-invariance: the backend agrees on it
        result.decisions.append({"members": [block.collective.name], "chose": "slice",
                                 "slice": fused.meta[SLICED], "local": True})
    if result.buckets:
        keep_output_strides(graph, strides, mode)
    result.changed = bool(result.buckets)
    return result
