"""Configuration of the fxcoalesce pipeline (plain data: no torch, no passes imported).

Pass names are checked twice: against ``DEFAULT_PASSES`` (every pass there is) when a
``Config`` is made, so a typo fails at the line that made it, naming the closest pass; and
against the registry by ``fxcoalesce.passes.check_config``, which every entry point calls.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import numbers
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

DEFAULT_PASSES = ("slice", "linearity", "bucket", "split", "fuse_norm", "lower", "schedule")
"""Every pass, in the order the pipeline runs them by default (``passes.PASSES`` has the same
names)."""


class ProfileError(ValueError):
    """A cost profile that cannot be used: missing, malformed, or made for another setup."""


def did_you_mean(name: str, known, *, quote: bool = True) -> str:
    """"did you mean 'reassociate'?" for the entry of ``known`` closest to ``name`` (difflib),
    "" when none is close; ``quote=False`` for options: "did you mean --tp?"."""
    close = difflib.get_close_matches(name, list(known), n=1)
    if not close:
        return ""
    return f"did you mean {close[0]!r}?" if quote else f"did you mean {close[0]}?"


def _fields_named(cls):
    """Make ``cls(**kwargs)`` refuse a keyword that is no field of the dataclass ``cls`` with
    the closest field's name (``Config(reasociate=True)``: did you mean 'reassociate'?)."""
    init = cls.__init__
    names = tuple(f.name for f in fields(cls))

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if args:  # Config(False): which field was meant is not for us to guess
            given = ", ".join(map(repr, args))
            raise TypeError(f"{cls.__name__}() takes keyword arguments only, e.g. "
                            f"{cls.__name__}({names[0]}=...), not {cls.__name__}({given}); "
                            f"its fields: {', '.join(names)}")
        for key in kwargs:
            if key not in names:
                hint = did_you_mean(key, names) or f"its fields: {', '.join(names)}"
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument "
                                f"{key!r}; {hint}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One piece of a piecewise alpha-beta fit: t = alpha + beta * bytes up to ``up_to_bytes``."""

    up_to_bytes: int
    alpha_us: float
    beta_us_per_byte: float


def _piecewise(segments, alpha_us: float, beta_us_per_byte: float, nbytes: int) -> float:
    for seg in segments:
        if nbytes <= seg.up_to_bytes:
            return seg.alpha_us + seg.beta_us_per_byte * nbytes
    last = segments[-1] if segments else None
    return (last.alpha_us + last.beta_us_per_byte * nbytes if last is not None
            else alpha_us + beta_us_per_byte * nbytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class ImplCurve:
    """Measured time of one all_reduce implementation other than NCCL (``calibrate`` on GPUs):
    piecewise alpha-beta up to ``max_bytes``, the largest size it was measured at (and its
    buffers sized for); past it the implementation is not chosen."""

    segments: tuple[Segment, ...]
    max_bytes: int

    def us(self, nbytes: int) -> float:
        return _piecewise(self.segments, 0.0, 0.0, nbytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommProfile:
    """Measured all_reduce latency of one setup (``fxcoalesce calibrate`` writes it)."""

    backend: str
    device: str
    world_size: int
    alpha_us: float
    """Fixed cost of one all_reduce (µs), from the single-line fit."""
    beta_us_per_byte: float
    """Cost per byte (µs/B), from the single-line fit."""
    segments: tuple[Segment, ...] = ()
    """Piecewise fit used for predictions (the single line when empty)."""
    nccl_mode: str | None = None
    source: str = ""
    """Where it was read from."""
    implementations: tuple[tuple[str, ImplCurve], ...] = ()
    """Curves of the other implementations measured (``one_shot``, ``two_shot``,
    ``fused_add_rms_norm``); a profile without them (older ones, CPU ones) is NCCL only."""
    digest: str = ""
    """sha256 of the profile file's content: ranks compare it (a lowered collective names it)."""

    def all_reduce_us(self, nbytes: int) -> float:
        return _piecewise(self.segments, self.alpha_us, self.beta_us_per_byte, nbytes)

    def curve(self, impl: str) -> ImplCurve | None:
        return dict(self.implementations).get(impl)


@_fields_named
@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """What the passes and the report predict time with.

    Communication: a calibrated :class:`CommProfile` when given, else a ring all_reduce after
    NCCL's tuner (``comm_analysis.py``): ``t = base_us + 2(n-1)·hop_us + 2(n-1)/n · bytes /
    bandwidth`` with NCCL's Simple-protocol PCIe latencies and a PCIe 4.0 x16 bandwidth.
    Compute: a roofline per graph node, ``max(flops / peak, bytes / memory bandwidth)``, plus a
    launch cost for each node that becomes a kernel of its own (matmuls, attention).
    """

    base_us: float = 8.4
    """Fixed launch latency of one collective (µs), ring model."""
    hop_us: float = 5.7
    """Latency per ring hop (µs); a ring all_reduce makes 2(n-1) hops."""
    bandwidth_gbps: float = 20.0
    """Bus bandwidth in GB/s, ring model."""
    profile: CommProfile | None = None
    """Calibrated all_reduce latency; replaces the ring model (``CostModel.from_profile``)."""
    peak_tflops: float | None = None
    """Compute roofline: attainable TFLOP/s (None: a default for the graph's device)."""
    memory_gbps: float | None = None
    """Compute roofline: attainable memory bandwidth in GB/s (None: device default)."""
    kernel_us: float | None = None
    """Launch cost of one kernel in µs (None: device default)."""
    overlap_efficiency: float = 1.0
    """Share of a collective that compute running in its window hides: hidden =
    efficiency · min(T, window). 1 = perfect overlap; ``calibrate`` measures it (NCCL's
    kernels share the GPU with the compute they overlap)."""
    overlap_curve: tuple[tuple[int, float], ...] = ()
    """The efficiency per all_reduce size, ``((bytes, efficiency), ...)`` ascending, where
    ``calibrate`` measured it: a collective's own size reads it (log-linear between points,
    the end points beyond); ``overlap_efficiency`` where it is empty or no size is known."""

    def __post_init__(self):
        compute = [v for v in (self.peak_tflops, self.memory_gbps, self.kernel_us)
                   if v is not None]
        values = (self.base_us, self.hop_us, self.bandwidth_gbps, *compute)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise ValueError("CostModel values must be finite numbers")
        positive = [self.bandwidth_gbps] + [v for v in (self.peak_tflops, self.memory_gbps)
                                            if v is not None]
        if min(values) < 0 or min(positive) <= 0:
            raise ValueError("CostModel latencies must be >= 0 and bandwidths/peaks > 0")
        if not (isinstance(self.overlap_efficiency, (int, float))
                and 0.0 <= self.overlap_efficiency <= 1.0):
            raise ValueError("CostModel.overlap_efficiency must be between 0 and 1")
        curve = self.overlap_curve
        if not all(isinstance(b, int) and b > 0 and isinstance(e, (int, float))
                   and 0.0 <= e <= 1.0 for b, e in curve) or \
                [b for b, _ in curve] != sorted({b for b, _ in curve}):
            raise ValueError("CostModel.overlap_curve must be ((bytes > 0, efficiency in "
                             "[0, 1]), ...) in ascending bytes")

    def efficiency(self, nbytes: int | None = None) -> float:
        """The overlap efficiency of an all_reduce of ``nbytes`` (:attr:`overlap_curve`)."""
        curve = self.overlap_curve
        if not curve or nbytes is None:
            return self.overlap_efficiency
        if nbytes <= curve[0][0]:
            return curve[0][1]
        for (b0, e0), (b1, e1) in zip(curve, curve[1:]):
            if nbytes <= b1:
                w = math.log(nbytes / b0) / math.log(b1 / b0)
                return e0 + w * (e1 - e0)
        return curve[-1][1]

    def hidden_us(self, t_us: float, window_us: float, nbytes: int | None = None) -> float:
        """The part of a collective of ``t_us`` (``nbytes``) hidden by ``window_us`` of
        compute."""
        return self.efficiency(nbytes) * max(0.0, min(t_us, window_us))

    def impl_us(self, impl: str, nbytes: int, world_size: int) -> float | None:
        """Predicted time of one all_reduce of ``nbytes`` run by ``impl`` ("nccl" is
        :meth:`all_reduce_us`); None when the profile has no curve for ``impl`` or ``nbytes``
        is past the largest size it was measured at (:meth:`impl_missing` says which)."""
        if impl == "nccl":
            return self.all_reduce_us(nbytes, world_size)
        curve = self.profile.curve(impl) if self.profile is not None else None
        if curve is None or nbytes > curve.max_bytes:
            return None
        return curve.us(nbytes)

    def impl_missing(self, impl: str, nbytes: int) -> str | None:
        """Why :meth:`impl_us` has no prediction for ``impl`` at ``nbytes`` (None if it has)."""
        if impl == "nccl":
            return None
        curve = self.profile.curve(impl) if self.profile is not None else None
        if curve is None:
            where = f"the profile {self.profile.source}" if self.profile else "no cost profile"
            return (f"{where} has no {impl} curve (fxcoalesce calibrate --device cuda "
                    "measures it)")
        if nbytes > curve.max_bytes:
            return (f"{nbytes} B is past the largest size calibrated for {impl} "
                    f"({curve.max_bytes} B)")
        return None

    def all_reduce_us(self, nbytes: int, world_size: int) -> float:
        """Predicted time of one all_reduce of ``nbytes`` over ``world_size`` ranks."""
        if self.profile is not None:
            return self.profile.all_reduce_us(nbytes)
        n = max(world_size, 1)
        if n == 1:
            return 0.0
        wire = 2 * (n - 1) / n * nbytes
        return self.base_us + 2 * (n - 1) * self.hop_us + wire / (self.bandwidth_gbps * 1e3)

    def check_setup(self, world_size: int | None, backend: str | None) -> None:
        """Raise :class:`ProfileError` if the profile was measured for another setup."""
        p = self.profile
        if p is None:
            return
        if world_size is not None and p.world_size != world_size:
            raise ProfileError(f"cost profile {p.source or ''} was measured at world size "
                               f"{p.world_size}, but this graph runs on {world_size} ranks; "
                               f"calibrate with --tp {world_size}")
        if backend is not None and backend != "fake" and p.backend != backend:
            raise ProfileError(f"cost profile {p.source or ''} was measured with {p.backend}, "
                               f"but this graph's group uses {backend}")

    @classmethod
    def from_profile(cls, path: str | Path) -> CostModel:
        """The model in a ``profile.json`` written by ``fxcoalesce calibrate``."""
        return cls(**_read_profile(Path(path)))


def _segments(rows) -> tuple[Segment, ...]:
    return tuple(Segment(up_to_bytes=int(s["up_to_bytes"]), alpha_us=float(s["alpha_us"]),
                         beta_us_per_byte=float(s["beta_us_per_byte"])) for s in rows)


def _read_profile(path: Path) -> dict:
    hint = "make one with `fxcoalesce calibrate --tp N --out PATH`"
    if path.is_dir():
        raise ProfileError(f"cost profile {path}: a directory, not a profile file; {hint}")
    if not path.is_file():
        raise ProfileError(f"cost profile {path}: no such file; {hint}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"cost profile {path}: not valid JSON ({e}); {hint}") from None
    need = {"backend", "device", "world_size", "alpha_us", "beta_us_per_byte"}
    if not isinstance(data, dict) or not need <= set(data):
        missing = sorted(need - set(data)) if isinstance(data, dict) else sorted(need)
        raise ProfileError(f"cost profile {path}: missing {missing}; {hint}")
    try:
        segments = _segments(data.get("segments", ()))
        impls = tuple((str(name), ImplCurve(segments=_segments(c["segments"]),
                                            max_bytes=int(c["max_bytes"])))
                      for name, c in sorted(data.get("implementations", {}).items())
                      if name != "nccl")
        profile = CommProfile(
            backend=str(data["backend"]), device=str(data["device"]),
            world_size=int(data["world_size"]), alpha_us=float(data["alpha_us"]),
            beta_us_per_byte=float(data["beta_us_per_byte"]), segments=segments,
            nccl_mode=data.get("nccl_mode"), source=str(path), implementations=impls,
            digest=hashlib.sha256(path.read_bytes()).hexdigest())
        compute = {k: float(v) for k, v in data.get("compute", {}).items()
                   if k in ("peak_tflops", "memory_gbps", "kernel_us")}
        if "overlap" in data:
            compute["overlap_efficiency"] = float(data["overlap"]["efficiency"])
            curve = sorted((int(q["bytes"]), float(q["efficiency"]))
                           for q in data["overlap"].get("points", ()))
            if any(not 0.0 <= e <= 1.0 for _, e in curve):
                raise ValueError("an overlap point's efficiency is not between 0 and 1")
    except (TypeError, ValueError, KeyError) as e:
        raise ProfileError(f"cost profile {path}: bad value ({e}); {hint}") from None
    numbers = [profile.alpha_us, profile.beta_us_per_byte, *compute.values()] + [
        v for s in (*segments, *(s for _, c in impls for s in c.segments))
        for v in (s.alpha_us, s.beta_us_per_byte)]
    if not all(math.isfinite(v) and v >= 0 for v in numbers) or profile.world_size < 1:
        raise ProfileError(f"cost profile {path}: values must be finite and >= 0; {hint}")
    if compute.get("overlap_efficiency", 0.0) > 1.0:
        raise ProfileError(f"cost profile {path}: overlap.efficiency must be between 0 and 1; "
                           f"{hint}")
    out = {"profile": profile, **compute}
    if "overlap" in data:
        out["overlap_curve"] = tuple(dict(curve).items())
    return out


def unknown_pass(name: str, where: str = "passes") -> str:
    """The error for a pass name that is not one of ``DEFAULT_PASSES``: the closest known."""
    hint = f"{hint} " if (hint := did_you_mean(name, DEFAULT_PASSES)) else ""
    return (f"unknown pass name {name!r} in {where}; {hint}known: "
            f"{', '.join(sorted(DEFAULT_PASSES))}")


@_fields_named
@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """What the fxcoalesce pipeline does to each compiled graph."""

    passes: tuple[str, ...] = DEFAULT_PASSES
    """Names of the passes to run, in order (see ``fxcoalesce.passes.PASSES``); a list is
    kept as a tuple."""
    disable: tuple[str, ...] = ()
    """Pass names to skip even if listed in ``passes``."""
    bucket_cap_mb: float = 512.0
    """Largest fused all_reduce, in MB; a level with more bytes is split into several buckets."""
    reassociate: bool = True
    """Allow rewrites that change floating-point summation order: the linearity pass adds
    partial sums before one all_reduce instead of adding several reduced values (fewer
    launches and bytes). ``False`` keeps results bit-exact with the unrewritten graph."""
    strict: bool = False
    """Re-raise exceptions from passes instead of falling back to the unmodified graph."""
    codegen: str = "inductor"
    """Backend code generator: "inductor" (compile_fx_inner) or "eager" (run the FX graph)."""
    dump_dir: str | os.PathLike | None = None
    """If set, write each graph before/after the pipeline and its report.json there."""
    slack_aware: bool = True
    """Let the cost model decide, per group of independent all_reduces, whether to merge them
    or issue them separately behind compute (each bucket's choice and the predicted
    alternative are in the report). The estimates read this rank's compute, which can differ
    between ranks, so the ranks compare the resulting collectives at compile time and, if
    they differ, take the ladder's next step (``agreement``: no choice that reads compute,
    then the program's own order). ``False``: always merge."""
    check_ranks: bool = False
    """Raise :class:`~fxcoalesce.CollectiveMismatchError` at a graph's first call, on every
    rank and before any of its collectives runs, where the ranks would issue different
    collectives (their rewrites differ, or the program itself differs) instead of falling
    back together; also compares graphs no pass could change. A different cut of the program
    into graphs (a ``print`` on one rank) is no such difference. ``FXCOALESCE_CHECK_RANKS=1``
    turns it on in the backend."""
    agree_timeout_s: float | None = None
    """How long a rank waits at compile time for its peers' proposals for a graph (through
    the process group's store, ``agreement``) before every rank compiles it in the program's
    own collective order, which pairs whatever the peers do. None: ``FXCOALESCE_AGREE_TIMEOUT``
    or 120 s. A wait ends early when a peer compiles another graph at the same place."""
    cost: CostModel = field(default_factory=CostModel)
    """Cost model used for the report's predicted communication time."""
    dump_passes: bool = False
    """With ``dump_dir``: also write the graph after each pass that changed it
    (``after_<pass>.txt``), to see which pass did what."""
    run_checks: bool = True
    """Make a run-time mispairing loud: where ranks agree on a graph, its all_reduces carry a
    tag that every rank checks after the collective (``ranks.tag``), so a peer that runs
    another graph there (it re-cut or recompiled alone a stretch the ranks agreed to run
    rewritten) raises on every rank instead of computing wrong values. It costs one element
    per tagged all_reduce and a copy where the producer cannot write into the tagged
    buffer, and keeps each graph's first all_reduce out of buckets, slices and lowerings.
    Must be the same on every rank. ``False``: no tags (a re-cut can then pair wrong)."""
    token_split: bool | None = None
    """Split the tokens of each token-parallel stretch in two and stagger the parts, so each
    part's all_reduce runs under the other's compute (the ``split`` pass). None: where a
    cost model you gave (a calibrated profile, or your own numbers) predicts it faster, never
    under 32 tokens nor by the default, uncalibrated model; True: wherever a stretch has two
    tokens or more; False: never. ``reassociate=False`` turns it off too (a part's matmul may
    take another kernel, summing in another order)."""
    lower: bool = True
    """Let ``fuse_norm`` and ``lower`` run all_reduces with the implementations a calibrated
    profile predicts faster (symmetric-memory one-shot / two-shot, the fused all_reduce + add
    + RMSNorm kernel; CUDA and NCCL only). ``False`` keeps every all_reduce on NCCL."""

    def __post_init__(self):
        for name in ("passes", "disable"):
            names = getattr(self, name)
            if isinstance(names, str):
                raise ValueError(f"{name} is a tuple of pass names, e.g. ('bucket',), "
                                 f"not the string {names!r}")
            if not (isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names)):
                raise TypeError(f"{name} must be a tuple (or list) of pass names, e.g. "
                                f"('bucket',), not {names!r}")
            object.__setattr__(self, name, tuple(names))  # a list is taken, kept as a tuple
            for n in names:
                if n not in DEFAULT_PASSES:
                    raise ValueError(unknown_pass(n, name))
        timeout = self.agree_timeout_s
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, numbers.Real)
                                    or not (math.isfinite(timeout) and timeout >= 0)):
            raise ValueError(f"agree_timeout_s must be a number of seconds >= 0 or None, not "
                             f"{timeout!r}")
        for name in ("reassociate", "strict", "slack_aware", "check_ranks", "lower", "dump_passes",
                     "run_checks"):
            if not isinstance(value := getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, not {value!r}")
        if not (self.token_split is None or isinstance(self.token_split, bool)):
            raise TypeError(f"token_split must be None (by cost), True or False, not "
                            f"{self.token_split!r}")
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
            raise TypeError(f"bucket_cap_mb must be a number of MB, not {cap!r}")
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"bucket_cap_mb must be a finite number > 0, not {cap!r}")
        if self.codegen not in ("inductor", "eager"):
            raise ValueError(f"codegen must be 'inductor' or 'eager', not {self.codegen!r}")
        if not isinstance(self.cost, CostModel):
            raise TypeError(f"cost must be a CostModel (e.g. CostModel.from_profile("
                            f"'profile.json')), not {self.cost!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise TypeError(f"dump_dir must be a directory (str or os.PathLike) or None, not "
                            f"{self.dump_dir!r}")
        if self.dump_dir is not None and not os.fspath(self.dump_dir):
            raise ValueError("dump_dir is empty; None (the default) dumps nothing")

    @property
    def enabled_passes(self) -> tuple[str, ...]:
        off = set(self.disable) | (set() if self.lower else {"fuse_norm", "lower"})
        return tuple(p for p in self.passes if p not in off)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)
