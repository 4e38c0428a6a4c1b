"""lower: run each remaining all_reduce with its fastest implementation.

Requires: comm blocks (``find_comm_blocks``); last but ``schedule`` in the pipeline. Ensures:
every analysed NCCL all_reduce whose calibrated alternative is predicted faster by a margin
(``Decider.lower``) runs as ``symm_mem.one_shot_all_reduce``, ``two_shot_all_reduce_`` or
``fxcoalesce.nccl_symm_all_reduce`` (NCCL's symmetric kernels on a registered window)
instead; the others stay NCCL, and the report records, per all_reduce, the choice, the
predicted alternatives and why any implementation was ruled out (``fxcoalesce.lowering``:
CPU, gloo, fp16, avg, world size 3, no curve in the profile, a size past the calibrated
ones...). Values are the same sums, in another order. The new op takes the collective's place
in the issue order and names the program's collective and the profile in its description,
so ranks compare both. Inductor realises the input in symmetric memory: the producing kernel
writes straight into a P2P buffer (whose id the pass makes this graph's own:
``lowering.distinct_p2p_ids``); under CUDA graphs the one-shot runs on a copy instead, and
nccl_symm always does (``kernels.nccl_symm``: Inductor allocates no NCCL windows), and so
does the one-shot, as its reference, for CPU tensors under
``fxcoalesce.testing.reference_lowering``.

    before                                        after
    %ar = all_reduce(%x, "sum", "0")              %y = symm_mem.one_shot_all_reduce(%x, "sum", "0")
    %w  = wait_tensor(%ar)                        %o = add(%y, %h)
    %o  = add(%w, %h)
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

import fxcoalesce.kernels  # noqa: F401  (registers fxcoalesce::one_shot_all_reduce)
from fxcoalesce.analysis import analyze
from fxcoalesce.config import Config
from fxcoalesce.kernels.fakes import ensure_symm_mem_fakes
from fxcoalesce.lowering import (CUDAGRAPH_P2P, NCCL_SYMM, distinct_p2p_ids, profile_tag,
                                 runs_reference, under_cudagraphs)
from fxcoalesce.meta import (ORIGIN, REPLACES, fake_mode_of, origin, propagate_val, replaced,
                             tensor_val)

from .decide import Decider
from .result import Bucket, PassResult
from fxcoalesce.checked import pinned_blocks

aten = torch.ops.aten
PINNED = ("the graph's first all_reduce stays a plain all_reduce: it carries the run-time "
          "check that peers run the same graph (ranks.tag)")
NCCL_COPY_IN = ("copy-in: NCCL's all_reduce on fxcoalesce's registered window (Inductor "
                "allocates no NCCL windows; under CUDA graphs none can be in the graph's pool)")


def lower_pass(gm: GraphModule, *, cfg: Config, pinned: frozenset = frozenset()
               ) -> PassResult:
    result = PassResult()
    analysis = analyze(gm)
    decider = Decider.of(analysis, cfg)
    graph = gm.graph
    mode = fake_mode_of(analysis.order)
    keep = pinned_blocks(analysis.scan, pinned)
    for info in analysis.infos:
        b = info.block
        if b.impl != "nccl":
            continue
        if b in keep:
            result.decisions.append({"members": [b.collective.name], "chose": "nccl",
                                     "ruled_out": {"all": PINNED}, "local": False})
            continue
        if b.inplace or b.copy_back is not None:
            why = "an in-place all_reduce_ (or one copied back into its buffer) stays"
            result.decisions.append({"members": [b.collective.name], "chose": "nccl",
                                     "ruled_out": {"all": why}, "local": False})
            continue
        chosen, record = decider.lower(info)
        result.decisions.append(record)
        if chosen == "nccl":
            continue
        x, group = b.input, b.group  # a name (lowering.symm_unusable)
        with graph.inserting_before(b.collective):
            reference = runs_reference(b.key)  # testing.reference_lowering: CPU tensors
            if chosen == NCCL_SYMM:  # on a copy: Inductor cannot allocate a window
                new = graph.call_function(torch.ops.fxcoalesce.nccl_symm_all_reduce.default,
                                          (x, group))
                propagate_val(new, mode)
                record["variant"] = NCCL_COPY_IN
            elif chosen == "one_shot" and (reference or under_cudagraphs()):  # on a copy
                new = graph.call_function(torch.ops.fxcoalesce.one_shot_all_reduce.default,
                                          (x, group))
                propagate_val(new, mode)
                if not reference:  # its reference needs no workspace
                    record["variant"] = "copy-in: " + CUDAGRAPH_P2P
            elif chosen == "one_shot":
                new = graph.call_function(torch.ops.symm_mem.one_shot_all_reduce.default,
                                          (x, "sum", group))
                propagate_val(new, mode)
            else:  # in place: on a buffer no other node reads, so none sees the sum
                ensure_symm_mem_fakes()  # Inductor re-propagates fake values (none in 2.11)
                own = x
                if len(x.users) > 1 or x.op != "call_function" or tensor_val(x)._is_view():
                    own = graph.call_function(aten.clone.default, (x,),
                                              {"memory_format": torch.contiguous_format})
                    propagate_val(own, mode)
                new = graph.call_function(torch.ops.symm_mem.two_shot_all_reduce_.default,
                                          (own, "sum", group))
                new.meta["val"] = own.meta["val"]  # returns its input (no fake kernel in 2.11)
        new.meta[REPLACES] = replaced([b.collective])
        new.meta[ORIGIN] = f"{origin(b.collective)} [{profile_tag(cfg)}]"
        b.wait.replace_all_uses_with(new)
        graph.erase_node(b.wait)
        graph.erase_node(b.collective)
        result.buckets.append(Bucket(members=[b.collective.name], nbytes=b.nbytes,
                                     level=info.level, key=str(b.key), collective=new.name,
                                     kind=chosen))
    result.changed = bool(result.buckets)
    if any(b.kind in ("one_shot", "two_shot") for b in result.buckets) and not under_cudagraphs():
        distinct_p2p_ids(graph_key(gm))  # Inductor allocates P2P buffers for these
    return result


def graph_key(gm: GraphModule) -> str:
    """The graph's code and its inputs' shapes, dtypes and strides: what sizes its buffers."""
    inputs = [(n.name, tuple(v.shape), str(v.dtype), tuple(v.stride()))
              for n in gm.graph.find_nodes(op="placeholder")
              if isinstance(v := n.meta.get("val"), torch.Tensor)]
    return str(gm.graph) + repr(inputs)
