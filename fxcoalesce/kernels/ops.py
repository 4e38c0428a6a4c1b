"""``torch.ops.fxcoalesce.all_reduce_add_rms_norm``: all_reduce(sum) + residual add + RMSNorm
as one op, for the ``fuse_norm`` pass to put where an all_reduce feeds a Llama-style
``h = h + all_reduce(x); y = rms_norm(h)``.

    fxcoalesce::all_reduce_add_rms_norm(Tensor input, Tensor? residual, Tensor weight,
        float eps, str group_name) -> (Tensor normed, Tensor residual_out)

Semantics (every implementation; ``H = input.shape[-1]``, rows are the leading dims):

    acc          = sum over the group's ranks of f32(input)  (+ f32(residual) if given)
    residual_out = acc.to(input.dtype)                             # rounded once
    x            = f32(residual_out)
    normed       = (x * rsqrt(mean(x * x, -1, keepdim=True) + eps) * f32(weight)).to(dtype)

Both outputs are new contiguous tensors of ``input``'s shape and dtype; no input is changed.
``residual=None`` is a first layer's form (no residual stream yet): ``residual_out`` is the
reduced input. ``normed`` is exactly ``F.rms_norm(residual_out, (H,), weight, eps)``'s
arithmetic (ATen's composite, which Inductor compiles: fp32 upcast, x * rsqrt(mean + eps),
times the weight in fp32, one cast back), so a pass that replaces ``all_reduce -> add ->
rms_norm`` changes only ``residual_out``'s rounding: the unfused graph rounds the all_reduce's
result to the dtype and then the add, this op rounds the fp32 sum once. In fp32 the two agree
to fp32 roundoff (bit for bit at 2 ranks). In bf16 (u = 2^-8, half an ulp), at 2 ranks, they
differ by at most u (|S| (1 + u) + 2 |S + residual|) per element, S the exact sum of the
partials (the unfused all_reduce's rounding plus two of the add; tests/test_kernels.py checks
it); at W ranks the unfused all_reduce rounds inside the reduction too, about (W - 1) u
sum |x_r| for the first term. ``normed`` follows through the norm. The fused residual_out is
within half an ulp of the exact sum (an fp32 sum of a few bf16 values is exact or nearly).

Implementations: the fake (shapes only) for tracing and Inductor, which places the op as an
extern kernel; the reference (any device: c10d ``all_reduce`` of an fp32 copy on the group
named ``group_name``, identity with no peers, then torch ops); on CUDA, the one Triton kernel
of ``triton_ar_norm`` over symmetric memory when ``symm_mem_ready(group_name)`` holds,
Triton imports, and the shape fits (``kernel_supports``), else the reference. Each of these
conditions is the same on every rank (an agreed vote, one environment, the shapes), so all
ranks take the same path. The op is for inference: it has no autograd formula.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from . import symm

try:
    from . import triton_ar_norm
except ImportError:  # no Triton (CPU machines): the reference serves every device
    triton_ar_norm = None

HAS_TRITON = triton_ar_norm is not None
OP_NAME = "fxcoalesce::all_reduce_add_rms_norm"
SCHEMA = ("all_reduce_add_rms_norm(Tensor input, Tensor? residual, Tensor weight, float eps, "
          "str group_name) -> (Tensor normed, Tensor residual_out)")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_MAX_WORLD = 8

dispatch_counts: Counter = Counter()
"""Calls per path in this process ("triton", "reference"): lets a test or a benchmark check
which implementation actually ran."""

_lib = torch.library.Library("fxcoalesce", "FRAGMENT")
_lib.define(SCHEMA)


def _check(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if input.dim() < 1 or weight.shape != input.shape[-1:]:
        raise ValueError(f"{OP_NAME}: weight must have shape [{input.shape[-1:]}] (the last "
                         f"dim of input {list(input.shape)}), not {list(weight.shape)}")
    if residual is not None and (residual.shape != input.shape
                                 or residual.dtype != input.dtype):
        raise ValueError(f"{OP_NAME}: residual must match input ({input.dtype}"
                         f"{list(input.shape)}), not {residual.dtype}{list(residual.shape)}")


@torch.library.register_fake(OP_NAME, lib=_lib)
def _fake(input, residual, weight, eps, group_name):
    _check(input, residual, weight)
    return input.new_empty(input.shape), input.new_empty(input.shape)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm``'s arithmetic, written out: fp32 throughout, one cast to x's dtype."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv * weight.float()).to(x.dtype)


def reference(input, residual, weight, eps, group_name):
    """The arithmetic reference on any device: c10d all_reduce of an fp32 copy of ``input``
    over the named group (none without peers), the residual added in fp32, one rounding."""
    _check(input, residual, weight)
    acc = input.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if symm.group_size(group_name) > 1:
        dist.all_reduce(acc, group=symm.resolve_group(group_name))
    if residual is not None:
        acc += residual.float()
    residual_out = acc.to(input.dtype)  # acc itself in fp32: our own copy, not an input
    return rms_norm_f32(residual_out, weight, eps), residual_out


def kernel_supports(shape, dtype: torch.dtype, world_size: int) -> tuple[bool, str]:
    """Whether the Triton kernel takes this call (rank-invariant facts only), and why not."""
    if not HAS_TRITON:
        return False, "Triton is not importable"
    if dtype not in KERNEL_DTYPES:
        return False, f"dtype {dtype} (the kernel takes bf16, fp16, fp32)"
    if not 1 <= world_size <= KERNEL_MAX_WORLD:
        return False, f"world size {world_size} (the kernel takes 1-{KERNEL_MAX_WORLD})"
    if not 1 <= shape[-1] <= triton_ar_norm.MAX_HIDDEN:
        return False, f"hidden {shape[-1]} (the kernel takes up to {triton_ar_norm.MAX_HIDDEN})"
    return True, "ok"


def _reference_impl(input, residual, weight, eps, group_name):
    dispatch_counts["reference"] += 1
    return reference(input, residual, weight, eps, group_name)


def _cuda_impl(input, residual, weight, eps, group_name):
    _check(input, residual, weight)
    fits, _ = kernel_supports(input.shape, input.dtype, symm.group_size(group_name))
    if not fits or not symm.symm_mem_ready(group_name)[0]:
        return _reference_impl(input, residual, weight, eps, group_name)
    dispatch_counts["triton"] += 1
    hidden = input.shape[-1]
    x = input.reshape(-1, hidden).contiguous()
    normed, residual_out = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0] > 0:
        ws = symm.get_workspace(group_name, input.device, x.numel() * x.element_size())
        res = None if residual is None else residual.reshape(-1, hidden).contiguous()
        triton_ar_norm.launch(x, res, weight.contiguous(), float(eps), normed, residual_out,
                              ws.handle, ws.max_blocks)
    return normed.view(input.shape), residual_out.view(input.shape)


_lib.impl("all_reduce_add_rms_norm", _reference_impl, "CompositeExplicitAutograd")
_lib.impl("all_reduce_add_rms_norm", _cuda_impl, "CUDA")  # CUDA tensors take this one
