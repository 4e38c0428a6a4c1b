"""Test-only: make ``fuse_norm`` and ``lower`` fire on CPU ranks (gloo, or a fake group), their
ops running the reference implementations, so that every rewrite they make can be checked
against eager where no GPU is. Not for serving: the references are slower than NCCL.

    with fxcoalesce.testing.reference_lowering():
        cfg = Config(cost=reference_cost(world_size=2), passes=("fuse_norm", "lower"))
        out = torch.compile(fn, backend=fxcoalesce.backend(cfg))(x)   # compiled inside

Inside, ``lowering.symm_unusable`` no longer rules out tensors off CUDA, nor groups other than
NCCL ones, for such tensors: ``fuse_norm`` may put ``fxcoalesce::all_reduce_add_rms_norm``
and ``lower`` a one-shot (as ``fxcoalesce::one_shot_all_reduce``), each a c10d all_reduce on
the group and torch ops (``kernels.ops.reference``); the two-shot has no reference and stays
ruled out. ``lowering.symm_problem`` tests and prepares symmetric memory on NCCL groups only,
so no collective runs for such groups at compile time. CUDA tensors keep every rule.

Rank-invariance: the switch is process state that the test's code sets alike on every rank;
a lowered collective's description says "reference lowering", so ranks where it differs
compare different sequences and keep the program's own. It is read when a graph compiles:
compile inside it. AOTAutograd's cache is off inside (its key does not cover the switch), so
a compile inside neither reads nor leaves code that a compile outside could be served.
"""

from __future__ import annotations

import contextlib
import hashlib

from .config import CommProfile, CostModel, ImplCurve, Segment

_active = 0
_simulated: dict[str, tuple[int, ...]] = {}


def reference_lowering_active() -> bool:
    """Whether :func:`reference_lowering` is in force (``lowering`` reads it)."""
    return _active > 0


@contextlib.contextmanager
def reference_lowering():
    """Let the lowering choose the fused op and the one-shot for CPU tensors, on any group,
    running their reference implementations (see the module docstring)."""
    global _active
    from torch._functorch import config as functorch_config

    with functorch_config.patch(enable_autograd_cache=False):
        _active += 1
        try:
            yield
        finally:
            _active -= 1


@contextlib.contextmanager
def simulated_groups(groups: dict[str, tuple[int, ...]]):
    """Hand-built graphs name groups no process group here has ("0", "1"): inside, a group
    name in ``groups`` counts as a group of those ranks where the passes ask whether a graph
    has peers and which groups' ranks contain which (``ranks.tag``: a graph's first
    all_reduce of a group stays out of buckets, as it does on real ranks). Simulated
    multi-rank tests (``tests/test_property_ranks.py``) compile their ranks' graphs inside
    it; nothing else reads it."""
    saved = dict(_simulated)
    _simulated.update({name: tuple(ranks) for name, ranks in groups.items()})
    try:
        yield
    finally:
        _simulated.clear()
        _simulated.update(saved)


def simulated_group_members(name: str | None) -> tuple[int, ...] | None:
    """The ranks :func:`simulated_groups` gives group ``name`` (None outside, or not named)."""
    return _simulated.get(name) if name is not None else None


def reference_cost(world_size: int = 2, backend: str = "gloo", *, nccl_us: float = 20.0,
                   one_shot_us: float = 10.0, fused_us: float = 4.0) -> CostModel:
    """A cost model that says the one-shot and the fused kernel win at every size (flat
    curves of these µs), for the ``world_size`` and ``backend`` of the test's group."""
    def flat(us: float) -> ImplCurve:
        return ImplCurve(segments=(Segment(up_to_bytes=1 << 40, alpha_us=us,
                                           beta_us_per_byte=0.0),), max_bytes=1 << 40)

    text = f"reference {world_size} {backend} {nccl_us} {one_shot_us} {fused_us}"
    profile = CommProfile(
        backend=backend, device="cpu", world_size=world_size, alpha_us=nccl_us,
        beta_us_per_byte=0.0, segments=flat(nccl_us).segments, source="fxcoalesce.testing",
        implementations=(("fused_add_rms_norm", flat(fused_us)), ("one_shot", flat(one_shot_us))),
        digest=hashlib.sha256(text.encode()).hexdigest())
    return CostModel(profile=profile)
