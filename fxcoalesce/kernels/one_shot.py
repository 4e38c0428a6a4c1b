"""``torch.ops.fxcoalesce.one_shot_all_reduce(Tensor input, str group_name) -> Tensor``:
torch's symmetric-memory one-shot sum of a copy of ``input`` in fxcoalesce's workspace.

The ``lower`` pass runs a one-shot this way under CUDA graphs. There, letting Inductor place
the input in a P2P buffer itself (``symm_mem.one_shot_all_reduce``, zero-copy) breaks torch
2.11's CUDA-graph trees: the P2P buffers it allocates inside the graph's memory pool are
flagged as leaked ("Detected 2 tensor(s) in the cudagraph pool not tracked as outputs",
measured on one H200, kimi-k2-tiny verify). The workspace (``symm.get_workspace``) is
allocated outside any graph pool, before capture; the price is one copy of the input, made
by torch's ``one_shot_all_reduce_copy``.

Reference (any device): c10d all_reduce of a copy over the named group, identity without
peers; the same sum as NCCL's, in another order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import symm

_lib = torch.library.Library("fxcoalesce", "FRAGMENT")
_lib.define("one_shot_all_reduce(Tensor input, str group_name) -> Tensor")


@torch.library.register_fake("fxcoalesce::one_shot_all_reduce")
def _fake(input, group_name):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _reference(input, group_name):
    out = input.clone(memory_format=torch.contiguous_format)
    if symm.group_size(group_name) > 1:
        dist.all_reduce(out, group=symm.resolve_group(group_name))
    return out


def _cuda(input, group_name):
    if not symm.symm_mem_ready(group_name)[0]:
        return _reference(input, group_name)
    x = input.contiguous()
    nbytes = x.numel() * x.element_size()
    ws = symm.get_workspace(group_name, x.device, nbytes)
    buf = ws.tensor[:nbytes].view(x.dtype).view(x.shape)  # offset 0: the rendezvoused base
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x, "sum", group_name)


_lib.impl("one_shot_all_reduce", _reference, "CompositeExplicitAutograd")
_lib.impl("one_shot_all_reduce", _cuda, "CUDA")
