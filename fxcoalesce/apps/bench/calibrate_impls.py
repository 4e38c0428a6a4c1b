"""What ``calibrate`` measures beside NCCL on CUDA ranks of an NCCL group: the
implementations the ``lower`` and ``fuse_norm`` passes choose from (``fxcoalesce.lowering``).

    one_shot            symm_mem.one_shot_all_reduce(buf[:n], "sum", group)
    two_shot            symm_mem.two_shot_all_reduce_(buf[:n], "sum", group)      (in place)
    fused_add_rms_norm  fxcoalesce.all_reduce_add_rms_norm(x, residual, weight, 1e-5, group)
                        x, residual: [bytes / (4096 x 2), 4096]; the op copies x into its
                        own symmetric workspace
    nccl_symm           fxcoalesce.nccl_symm_all_reduce(x, group): the op the lower pass
                        places, as it runs there: a copy of x into a registered NCCL window,
                        NCCL's all_reduce on it (its symmetric kernels), a copy out

torch's symmetric-memory backend is process-wide and fixed at the first symmetric
allocation: nccl_symm needs NCCL's, the three others torch's CUDA one. A run asked for
nccl_symm alone sets NCCL's (``kernels.nccl_symm.use_nccl_backend``, voted on) before
anything allocates; asked for it with the others, it keeps CUDA's and leaves nccl_symm out
(calibrate it in a run of its own). The profile's ``symm_backend`` says which one ran.

All in bf16, the dtype the models run in on GPUs (NCCL's curve stays float32, as before: its
time per byte does not depend on it); the profile says so per curve. one_shot and two_shot
reduce views of one symmetric buffer of the largest size (``_symmetric_memory.empty`` +
``rendezvous`` after ``enable_symm_mem_for_group``), peer-to-peer only: multicast stays off
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, which ``apps/launch.py`` sets for NCCL ranks; never
``multimem_*``). A size an implementation cannot take is skipped (``feasible``).

``prepare`` is collective: every rank takes the same steps, and every local failure is voted
on (``agree``) before the next collective step, so no rank waits in a collective its peers
skipped:

1. is symmetric memory usable? ``fxcoalesce.kernels.symm.symm_mem_ready`` when it imports,
   else a check of our own (allocate, rendezvous, read every peer's buffer over P2P); if not,
   every implementation is left out with the reason;
2. correctness, before any timing: at every size, random inputs on every rank, each rank's
   result against NCCL's (``_Impls.check``). An implementation that fails, or raises, is
   left out of the profile with the reason.

Bounds, bf16 (unit roundoff u = 2^-8, gamma_k = k u / (1 - k u)). The inputs x_r are exact
bf16 values; s = sum_r x_r, S = sum_r |x_r| (reduced in fp32 over NCCL). Any summation of W
terms in bf16 with W - 1 rounded adds, in any order or tree (NCCL's ring or tree), is within
gamma_{W-1} S of s; an fp32 accumulation rounded once to bf16 is within u |s| <= gamma_1 S.
So NCCL's result and the implementation's both lie within gamma_{W-1} S (+ 2^-22 S for fp32
arithmetic) of s, and an element passes when they differ by at most twice that: at world size
1 both must be exact. The fused op: its ``residual_out`` rounds the fp32 sum plus the residual
once, the unfused graph rounds NCCL's sum, then the add, so they differ by at most
gamma_{W-1} S + u/(1-u) (|h| + |residual_out|) (h = the unfused sum); its ``normed`` must be
``F.rms_norm(residual_out)`` but for one rounding of the output: 2u of the value.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

ONE, TWO, FUSED, NSYMM = "one_shot", "two_shot", "fused_add_rms_norm", "nccl_symm"
DTYPE = torch.bfloat16
HIDDEN = 4096
"""Row width of the fused op's calibration: llama-3-8b's (the common served shape)."""
ROW_BYTES = HIDDEN * 2
EPS = 1e-5
U = 2.0 ** -8
"""bf16 unit roundoff (8 significant bits)."""
FP32_SLACK = 2.0 ** -22
"""fp32 arithmetic on exact bf16 values, as a share of the magnitudes summed."""
MIN_ALIGN = 4
"""The symm_mem kernels' smallest alignment: input bytes a multiple of max(4, itemsize)."""
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
_KEEP: list = []
"""Symmetric buffers peers mapped: they stay alive for the rank's lifetime."""


def feasible(impl: str, nbytes: int, world: int) -> bool:
    """Whether ``impl`` can reduce ``nbytes`` of bf16 at world size ``world``: the symm_mem
    kernels need 4-byte multiples; two_shot splits the elements evenly over the ranks; the
    fused op takes whole rows of ``HIDDEN``."""
    if impl == FUSED:
        return nbytes % ROW_BYTES == 0
    numel = nbytes // DTYPE.itemsize
    return nbytes % MIN_ALIGN == 0 and (impl != TWO or numel % world == 0)


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def sum_bound(S: torch.Tensor, world: int) -> torch.Tensor:
    """Largest difference, per element, between two bf16 all_reduce sums of ``world`` ranks'
    inputs whose absolute values sum to ``S`` (fp32): NCCL's and another's."""
    return 2 * (gamma(world - 1) + FP32_SLACK) * S


def residual_bound(S: torch.Tensor, h: torch.Tensor, out: torch.Tensor, r: torch.Tensor,
                   world: int) -> torch.Tensor:
    """Largest difference, per element, between the fused op's ``residual_out`` (fp32 sum
    plus the residual, rounded once) and the unfused ``h`` (NCCL's bf16 sum, plus the
    residual ``r`` in bf16)."""
    slack = U / (1 - U)
    return (gamma(world - 1) * S + slack * (h.float().abs() + out.float().abs())
            + FP32_SLACK * (S + r.float().abs()))


def rounding_bound(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Two fp32 computations of one value, each rounded once to bf16: one ulp apart at most."""
    return 2 * U * torch.maximum(ref.float().abs(), a.float().abs()) + FP32_SLACK * float(
        ref.float().abs().max())


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def agree(error: str | None, dev: torch.device) -> str | None:
    """None when no rank has an error, else the first failing rank's, on every rank (an
    all_reduce MIN, then, only after a failure, an all_gather_object of the reasons)."""
    flag = torch.tensor([0 if error else 1], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 1:
        return None
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, error)
    rank, why = next((r, w) for r, w in enumerate(reasons) if w)
    return f"rank {rank}: {why}"


def enable_symm_mem(group_name: str) -> None:
    """``enable_symm_mem_for_group`` (what Inductor checks in 2.11-2.13; deprecated, with a
    FutureWarning, in 2.13)."""
    from torch.distributed import _symmetric_memory as symm

    os.environ.setdefault(MULTICAST_ENV, "1")
    if not symm.is_symm_mem_enabled_for_group(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group_name)


def _own_symm_check(group_name: str, dev: torch.device) -> tuple[bool, str]:
    """Without ``fxcoalesce.kernels``: allocate and rendezvous a symmetric buffer, write a
    pattern of each rank's own, and read every peer's back over P2P (voted after each step)."""
    from torch.distributed import _symmetric_memory as symm

    n, state = 1024, {}

    def pattern(rank: int) -> torch.Tensor:  # exact in fp32, different on every rank
        return (rank + 1) * 1000.0 + torch.arange(n, dtype=torch.float32, device=dev)

    def allocate():
        enable_symm_mem(group_name)
        state["buf"] = symm.empty(n, dtype=torch.float32, device=dev)

    def rendezvous():  # collective: only once every rank allocated
        state["hdl"] = symm.rendezvous(state["buf"], group_name)
        _KEEP.append(state)

    def read_peers():
        hdl = state["hdl"]
        state["buf"].copy_(pattern(hdl.rank))
        hdl.barrier(channel=0, timeout_ms=30_000)
        for peer in range(hdl.world_size):
            if not torch.equal(hdl.get_buffer(peer, (n,), torch.float32), pattern(peer)):
                raise RuntimeError(f"wrong values read from peer {peer}'s buffer")
        hdl.barrier(channel=0, timeout_ms=30_000)  # peers are done reading ours

    for step, fn in (("allocate", allocate), ("rendezvous", rendezvous),
                     ("P2P read of every peer", read_peers)):
        try:
            fn()
            error = None
        except Exception as e:  # noqa: BLE001 - voted on, the same verdict on every rank
            error = f"{step}: {_first_line(e)}"
        if failed := agree(error, dev):
            return False, failed
    return True, "ok"


_STATUS: dict[str, dict] = {}


def symm_mem_status(group_name: str, dev: torch.device) -> dict:
    """The profile's ``symm_mem`` section: usable or not, why, and what checked (collective
    on its first call for a group, then cached)."""
    if group_name in _STATUS:
        return _STATUS[group_name]
    try:
        from fxcoalesce.kernels.symm import symm_mem_ready

        by = "fxcoalesce.kernels.symm.symm_mem_ready"
        ok, why = symm_mem_ready(group_name)
    except ImportError:
        by = "calibrate's own check (fxcoalesce.kernels does not import)"
        ok, why = _own_symm_check(group_name, dev)
    _STATUS[group_name] = {"usable": bool(ok), "why": why, "checked_by": by,
                           "multicast": f"off ({MULTICAST_ENV}={os.environ.get(MULTICAST_ENV)})"}
    return _STATUS[group_name]


def nccl_symm_status(group_name: str) -> dict:
    """The profile's ``symm_mem`` section for a run of nccl_symm: NCCL's window tested for
    real (``kernels.nccl_symm.ready``, collective, voted on)."""
    from fxcoalesce.kernels import nccl_symm

    ok, why = nccl_symm.ready(group_name)
    return {"usable": bool(ok), "why": why, "checked_by": "fxcoalesce.kernels.nccl_symm.ready",
            "multicast": f"off ({MULTICAST_ENV}={os.environ.get(MULTICAST_ENV)})"}


BACKEND_WHY = {"NCCL": "nccl_symm was asked for alone: NCCL's windows (set before any "
                       "symmetric allocation)",
               "CUDA": "torch's default, which one_shot, two_shot and the fused kernel need"}


def choose_backend(names: list[str], dev: torch.device) -> tuple[str | None, str | None]:
    """(the symmetric-memory backend this run uses, why nccl_symm is left out or None).
    NCCL's only when nccl_symm is the one symmetric-memory implementation asked for; the
    switch is voted on, so every rank ends on the same backend or gives nccl_symm up."""
    from fxcoalesce.kernels import nccl_symm

    if NSYMM not in names:
        return nccl_symm.process_backend(), None
    if len(names) > 1:
        return nccl_symm.process_backend(), (
            "torch's symmetric-memory backend is process-wide: this run keeps CUDA's for "
            f"{', '.join(n for n in names if n != NSYMM)}; calibrate nccl_symm in a run of its "
            "own (--impls nccl_symm)")
    ok, why = nccl_symm.use_nccl_backend()
    if failed := agree(None if ok else why, dev):
        return nccl_symm.process_backend(), f"NCCL's symmetric memory: {failed}"
    return nccl_symm.NCCL, None


def _fused_missing(world: int) -> str | None:
    """Why the fused op cannot be measured here: not registered, or it would run its
    reference (c10d all_reduce and torch ops) rather than the fused kernel."""
    try:
        import fxcoalesce.kernels as kernels
    except ImportError as e:
        return (f"fxcoalesce.kernels does not import ({_first_line(e)}), so "
                "torch.ops.fxcoalesce.all_reduce_add_rms_norm does not exist")
    if getattr(torch.ops.fxcoalesce, "all_reduce_add_rms_norm", None) is None:
        return "fxcoalesce.kernels registers no all_reduce_add_rms_norm"
    supports = getattr(kernels, "kernel_supports", None)
    if supports is not None:
        ok, why = supports((1, HIDDEN), DTYPE, world)
        if not ok:
            return f"the op would run its reference, not the fused kernel: {why}"
    return None


def _exceed(err: torch.Tensor, bound: torch.Tensor) -> tuple[float, str | None]:
    """(worst err / bound, a sentence about the elements past their bound, or None)."""
    bad = err > bound
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-30), (err > 0).float() * 1e30)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if not bool(bad.any()):
        return worst, None
    i = int(ratio.argmax())
    return worst, (f"{int(bad.sum())} of {err.numel()} elements past the bf16 bound (worst: "
                   f"element {i}, off by {float(err.flatten()[i]):.3g}, bound "
                   f"{float(bound.flatten()[i]):.3g})")


def _same_on_ranks(out: torch.Tensor) -> bool:
    first = out.clone()
    dist.broadcast(first, 0)
    return torch.equal(first, out)


class _Impls:
    """This rank's buffers for the implementations measured, their calls and their checks."""

    def __init__(self, names: list[str], top: int, dev: torch.device):
        """Allocate (local): ``rendezvous`` follows once every rank allocated."""
        from torch.distributed import _symmetric_memory as symm

        self.dev, self.group = dev, dist.group.WORLD.group_name
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.buf = None
        if ONE in names or TWO in names:
            enable_symm_mem(self.group)
            self.buf = symm.empty(top // DTYPE.itemsize, dtype=DTYPE, device=dev)
        if NSYMM in names:  # a plain input: the op copies it into its window, as lowered
            self.plain = torch.zeros(top // DTYPE.itemsize, dtype=DTYPE, device=dev)
            self.nccl_symm = torch.ops.fxcoalesce.nccl_symm_all_reduce.default
        self.top = top
        if FUSED in names:
            rows = top // ROW_BYTES
            self.x = self.randn((rows, HIDDEN), mine=True)
            self.residual = self.randn((rows, HIDDEN))
            self.weight = 1 + 0.1 * self.randn((HIDDEN,))
            self.op = torch.ops.fxcoalesce.all_reduce_add_rms_norm.default

    def rendezvous(self) -> None:
        """Map the peers' symmetric buffers (collective)."""
        from torch.distributed import _symmetric_memory as symm

        if self.buf is not None:
            _KEEP.append((self.buf, symm.rendezvous(self.buf, self.group)))
        if hasattr(self, "nccl_symm"):  # voted inside: the same verdict on every rank
            from fxcoalesce.kernels import nccl_symm

            ok, why = nccl_symm.prepare(self.group, self.dev, self.top)
            if not ok:
                raise RuntimeError(why)

    def randn(self, shape, mine: bool = False, seed: int = 0) -> torch.Tensor:
        """bf16 normals: this rank's own (``mine``), else the same on every rank (a
        replicated residual stream or weight)."""
        g = torch.Generator(device=self.dev).manual_seed(seed * 1009 + (self.rank + 1 if mine
                                                                        else 0))
        return torch.randn(shape, generator=g, device=self.dev).to(DTYPE)

    def call(self, impl: str, nbytes: int):
        """One call of ``impl`` on ``nbytes`` (zeros for one/two-shot: a repeated in-place
        sum stays finite)."""
        group = self.group
        if impl == FUSED:
            rows = nbytes // ROW_BYTES
            x, r, w, op = self.x[:rows], self.residual[:rows], self.weight, self.op
            return lambda: op(x, r, w, EPS, group)
        if impl == NSYMM:
            x, op = self.plain[:nbytes // DTYPE.itemsize], self.nccl_symm
            return lambda: op(x, group)
        view = self.buf[:nbytes // DTYPE.itemsize]
        op = (torch.ops.symm_mem.one_shot_all_reduce.default if impl == ONE
              else torch.ops.symm_mem.two_shot_all_reduce_.default)
        return lambda: op(view, "sum", group)

    def check(self, impl: str, nbytes: int, seed: int) -> dict:
        """``impl`` against NCCL on random inputs of ``nbytes``; raises naming the elements
        past the bound (module docstring); else {"worst": largest error / bound, "same":
        whether every rank got the same bits}. Every collective comes before any verdict,
        so a rank that fails has taken the same collectives as one that passes."""
        if impl == FUSED:
            return self._check_fused(nbytes // ROW_BYTES, seed)
        n = nbytes // DTYPE.itemsize
        x = self.randn((n,), mine=True, seed=seed)
        want = x.clone()
        dist.all_reduce(want)
        S = x.abs().float()
        dist.all_reduce(S)
        if impl == NSYMM:
            out = self.nccl_symm(x, self.group)
        elif impl == ONE:
            view = self.buf[:n]
            view.copy_(x)
            out = torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.group)
        else:
            view = self.buf[:n]
            view.copy_(x)
            out = torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", self.group).clone()
        same = _same_on_ranks(out)
        worst, why = _exceed((out.float() - want.float()).abs(), sum_bound(S, self.world))
        if why:
            raise AssertionError(f"{impl} against NCCL's sum: {why}")
        return {"worst": worst, "same": same}

    def _check_fused(self, rows: int, seed: int) -> dict:
        import torch.nn.functional as F

        x = self.randn((rows, HIDDEN), mine=True, seed=seed)
        r, w = self.randn((rows, HIDDEN), seed=seed + 1), self.weight
        counts = _dispatch_counts()
        before = counts.get("triton", 0) if counts is not None else 0
        normed, res_out = self.op(x, r, w, EPS, self.group)
        fused_ran = counts is None or counts.get("triton", 0) > before
        ar = x.clone()
        dist.all_reduce(ar)
        h = ar + r  # the unfused graph: NCCL's sum rounded, then the add rounded
        S = x.abs().float()
        dist.all_reduce(S)
        same = _same_on_ranks(normed) & _same_on_ranks(res_out)  # both collectives, always
        if not fused_ran:
            raise AssertionError("the op ran its reference (c10d all_reduce and torch ops), "
                                 "not the fused kernel")
        bound = residual_bound(S, h, res_out, r, self.world)
        worst, why = _exceed((res_out.float() - h.float()).abs(), bound)
        if why:
            raise AssertionError(f"residual_out against NCCL's sum plus the residual: {why}")
        ref = F.rms_norm(res_out, (HIDDEN,), w, EPS)
        worst_n, why = _exceed((normed.float() - ref.float()).abs(),
                               rounding_bound(normed, ref))
        if why:
            raise AssertionError(f"normed against F.rms_norm(residual_out): {why}")
        return {"worst": max(worst, worst_n), "same": same}


def _dispatch_counts():
    try:
        from fxcoalesce.kernels import ops
    except ImportError:
        return None
    return getattr(ops, "dispatch_counts", None)


def prepare(names: tuple[str, ...], byte_sizes: list[int], dev: torch.device
            ) -> tuple[dict, dict]:
    """(calls to time: {(implementation, bytes): fn}, facts for the profile) on this rank;
    collective (module docstring). Sizes are checked largest first, so the fused op's
    workspace is allocated once, before any CUDA-graph capture."""
    from fxcoalesce.lowering import SYMM_WORLDS

    world = dist.get_world_size()
    facts = {"left_out": {}, "skipped_sizes": {}, "checks": {}}
    names = [n for n in names if n in (ONE, TWO, FUSED, NSYMM)]
    if world not in SYMM_WORLDS:
        why = f"world size {world}: the symmetric-memory kernels run at 1, 2, 4 or 8 ranks"
        facts["symm_mem"] = {"usable": False, "why": why}
        facts["left_out"] = dict.fromkeys(names, why)
        return {}, facts
    if NSYMM in names and (why := choose_backend(names, dev)[1]):
        facts["left_out"][NSYMM] = why
        names.remove(NSYMM)
    group = dist.group.WORLD.group_name
    facts["symm_mem"] = status = (nccl_symm_status(group) if names == [NSYMM]
                                  else symm_mem_status(group, dev))
    if not status["usable"]:
        facts["left_out"] = dict.fromkeys(names, f"symmetric memory unusable: {status['why']}")
        return {}, facts
    if FUSED in names and (why := agree(_fused_missing(world), dev)):
        facts["left_out"][FUSED] = why.partition(": ")[2]
        names.remove(FUSED)
    sizes_of = {}
    for impl in list(names):
        sizes_of[impl] = [b for b in byte_sizes if feasible(impl, b, world)]
        facts["skipped_sizes"][impl] = [b for b in byte_sizes if b not in sizes_of[impl]]
        if not sizes_of[impl]:
            need = (f"one row of {HIDDEN} bf16 ({ROW_BYTES} B)" if impl == FUSED
                    else "a multiple of 4 bytes")
            facts["left_out"][impl] = f"no size up to {max(byte_sizes)} B holds {need}"
            names.remove(impl)
    if not names:
        return {}, facts
    impls = None
    for step in ("allocate", "rendezvous"):
        error = None
        try:
            if impls is None:
                impls = _Impls(names, max(max(sizes_of[i]) for i in names), dev)
            else:
                impls.rendezvous()
        except Exception as e:  # noqa: BLE001 - voted on
            error = _first_line(e)
        if failed := agree(error, dev):
            facts["left_out"].update(dict.fromkeys(names, f"{step} of its buffers: {failed}"))
            return {}, facts
    calls = {}
    for impl in names:
        worst, same, why = 0.0, True, None
        for seed, nbytes in enumerate(sorted(sizes_of[impl], reverse=True)):
            error = None
            try:
                result = impls.check(impl, nbytes, seed)
                worst, same = max(worst, result["worst"]), same and result["same"]
            except Exception as e:  # noqa: BLE001 - voted on
                error = f"{nbytes} B: {_first_line(e)}"
            if why := agree(error, dev):
                break
        if why:
            facts["left_out"][impl] = f"failed its correctness check: {why}"
            continue
        facts["checks"][impl] = {"sizes": len(sizes_of[impl]), "worst": worst, "same": same}
        calls.update({(impl, b): impls.call(impl, b) for b in sizes_of[impl]})
    if impls.buf is not None:
        impls.buf.zero_()
    torch.cuda.synchronize(dev)
    facts["symm_backend"] = symm_backend_fact(names)
    return calls, facts


def symm_backend_fact(names: list[str]) -> dict:
    """The profile's ``symm_backend``: torch's answer for this process, and why this one."""
    try:
        from fxcoalesce.kernels.nccl_symm import process_backend
    except ImportError:
        process_backend = lambda: None  # noqa: E731
    backend = process_backend()
    return {"backend": backend, "why": BACKEND_WHY.get(backend, "torch's answer"),
            "implementations": names,
            "rule": "one backend a process (torch fixes it at the first symmetric allocation)"}


BOUND = ("each element within twice gamma_{W-1} (u = 2^-8, bf16) of the sum of |inputs| "
         "from NCCL's result (fused: residual_out within gamma_{W-1} S + u (|h| + |out|), "
         "normed within one bf16 rounding of F.rms_norm(residual_out))")


def implementations_section(ranks: list[dict]) -> dict:
    """The profile's ``symm_mem``, ``implementations`` and ``implementations_left_out`` from
    every rank's facts: per size the slowest rank's median, one fit per implementation."""
    from fxcoalesce.apps.bench.fit import fit_rows
    from fxcoalesce.lowering import op_available

    first = ranks[0]
    section = {}
    for impl, measured in first.get("points", {}).items():
        points = {b: max(r["points"][impl][b] for r in ranks) for b in measured}
        segments, rows, worst = fit_rows(points)
        captured = first["captured"][impl]
        entry = {"segments": segments, "max_bytes": max(points), "dtype": "bfloat16",
                 "cudagraphs": all(captured), "points": rows, "max_abs_error_1KB_16MB": worst,
                 "check": {"sizes": first["checks"][impl]["sizes"],
                           "worst_error_over_bound": max(r["checks"][impl]["worst"]
                                                         for r in ranks),
                           "same_on_every_rank": all(r["checks"][impl]["same"] for r in ranks),
                           "bound": BOUND},
                 "skipped_sizes": first["skipped_sizes"].get(impl, [])}
        if not all(captured):
            entry["capture"] = (f"{captured.count(False)} of {len(captured)} sizes timed in an "
                                f"eager loop: {first['capture_errors'][impl]}")
        if impl == FUSED:
            entry.update({"hidden": HIDDEN, "residual": True, "eps": EPS,
                          "bytes": f"of the input: rows x {HIDDEN} x 2 (bf16)"})
        if why := op_available(impl):
            entry["lower"] = f"the lower pass cannot place it on this torch: {why}"
        section[impl] = entry
    return {"symm_mem": first["symm_mem"], "symm_backend": first.get("symm_backend"),
            "implementations": section,
            "implementations_left_out": first["left_out"]}
