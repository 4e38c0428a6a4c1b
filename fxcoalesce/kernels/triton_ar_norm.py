"""One Triton kernel: all_reduce(sum) + residual add + RMSNorm over symmetric memory (P2P).

Imported only where Triton is (``fxcoalesce.kernels.ops`` guards it). Per thread block, for
the rows ``pid, pid + grid, ...`` of a [rows, H] input:

    copy my rows into my workspace          st.global (input dtype)
    barrier #1 with block pid of every peer  (signal pads, below)
    acc = sum over ranks 0..W-1 of the peers' rows (P2P loads, fp32), + residual (fp32)
    residual_out = round(acc); normed = round(f32(residual_out) * rsqrt(mean(.^2) + eps) * w)
    barrier #2 with block pid of every peer

Rounding: one rounding of the fp32 sum to the input dtype (round to nearest even, as torch),
then RMSNorm of that rounded value in fp32 with one final rounding: ``normed`` is
``F.rms_norm(residual_out, (H,), weight, eps)``'s arithmetic (fp32 upcast, x * rsqrt(mean +
eps), times the fp32 weight, one cast), up to the fp32 summation order of the mean.

The barrier (``_block_barrier``; the signal-pad protocol of torch's symmetric memory and of
yifuwang/symm-mem-recipes, written with Triton atomics). Slot ``pad[r][b * W + p]`` of rank
r's signal pad carries "block b of rank p arrived". Arriving at it, a block's thread 0 CASes
0 -> 1 into that slot of every peer (release, system scope), spinning while the slot still
holds its previous, unconsumed signal; then CASes 1 -> 0 in each of its own W slots (acquire,
system scope), spinning until each peer's signal is there. Every signal is consumed exactly
once by the one rank that waits for it, so every slot is back to 0 when the kernel ends:
nothing for the host to reset, and a CUDA graph can replay it any number of times.

Memory ordering, for writes made in this same kernel. (1) A block's stores of its rows and
its peers' loads of them: every thread's stores precede a CTA barrier (``bar.sync``), which
synchronises with thread 0, whose release CAS (sys scope) is read by the peer's acquire CAS;
the peer then passes its own ``bar.sync`` before any thread loads. In the PTX memory model
the stores thus precede the loads in causality order (program order, barrier
synchronisation and release/acquire all compose), so the loads see them; the peer loads are
also ``.cg`` (L2, not a possibly stale L1 line). (2) The next call's stores into a workspace
and this call's loads from it: barrier #2 orders every block's loads before its peers'
release of that block, and a rank's next kernel on the stream starts only after all of its
blocks passed barrier #2, i.e. after every peer finished reading every row of it, whatever
rows map to which block in the next call's shape. Calls on one group must therefore be
ordered on one stream (as a group's collectives are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384
"""Widest row: a block holds one row in registers (16 warps x 32 lanes x 32 fp32 at most)."""


@triton.jit
def _block_barrier(signal_pad_ptrs, block_id, RANK: tl.constexpr, WORLD: tl.constexpr):
    tl.debug_barrier()  # all threads' memory operations so far come before the release
    pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
    mine = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
    for peer in tl.static_range(WORLD):
        theirs = tl.load(pads + peer).to(tl.pointer_type(tl.uint32))
        slot = theirs + block_id * WORLD + RANK
        while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
            pass
    for peer in tl.static_range(WORLD):
        slot = mine + block_id * WORLD + peer
        while tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()  # no thread reads peers' memory before thread 0 acquired


@triton.jit(do_not_specialize=["n_rows"])
def _all_reduce_add_rms_norm_kernel(
    in_ptr, res_ptr, w_ptr, normed_ptr, res_out_ptr, buffer_ptrs, signal_pad_ptrs,
    n_rows, eps,
    H: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = in_ptr.dtype.element_ty
    bufs = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    my_ws = tl.multiple_of(tl.load(bufs + RANK).to(tl.pointer_type(dtype)), 16)
    row = pid
    while row < n_rows:  # (a while loop: Triton's interpreter cannot index a range by pid)
        offs = row * H + cols
        tl.store(my_ws + offs, tl.load(in_ptr + offs, mask=mask), mask=mask)
        row += grid
    _block_barrier(signal_pad_ptrs, pid, RANK, WORLD)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    row = pid
    while row < n_rows:
        offs = row * H + cols
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # rank order: the same sum on every rank
            ws = tl.multiple_of(tl.load(bufs + peer).to(tl.pointer_type(dtype)), 16)
            acc += tl.load(ws + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = acc.to(dtype)
        tl.store(res_out_ptr + offs, r, mask=mask)
        x = r.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        tl.store(normed_ptr + offs, (x * inv * w).to(dtype), mask=mask)
        row += grid
    _block_barrier(signal_pad_ptrs, pid, RANK, WORLD)


def launch(input2d: torch.Tensor, residual2d: torch.Tensor | None, weight: torch.Tensor,
           eps: float, normed: torch.Tensor, residual_out: torch.Tensor, handle,
           max_blocks: int) -> None:
    """Run the kernel on contiguous [rows, H] tensors; the workspace behind ``handle`` must
    hold rows * H elements of the input dtype on every rank."""
    n_rows, hidden = input2d.shape
    block = triton.next_power_of_2(hidden)
    grid = (max(1, min(n_rows, max_blocks)),)
    _all_reduce_add_rms_norm_kernel[grid](
        input2d, input2d if residual2d is None else residual2d, weight, normed, residual_out,
        handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev, n_rows, eps,
        H=hidden, BLOCK=block, HAS_RESIDUAL=residual2d is not None,
        RANK=handle.rank, WORLD=handle.world_size,
        num_warps=min(16, max(4, block // 512)),
    )
