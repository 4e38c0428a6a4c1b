"""Configuration of the fxcoalesce pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PASSES = ("bucket", "schedule")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Alpha-beta ring all_reduce time, after NCCL's tuner (see ``comm_analysis.py``).

    ``t = base_us + 2(n-1)·hop_us + 2(n-1)/n · bytes / bandwidth``. The defaults are NCCL's
    Simple-protocol PCIe latencies and a PCIe 4.0 x16 bus bandwidth.
    """

    base_us: float = 8.4
    """Fixed launch latency of one collective (µs)."""
    hop_us: float = 5.7
    """Latency per ring hop (µs); a ring all_reduce makes 2(n-1) hops."""
    bandwidth_gbps: float = 20.0
    """Bus bandwidth in GB/s."""

    def __post_init__(self):
        if self.base_us < 0 or self.hop_us < 0 or self.bandwidth_gbps <= 0:
            raise ValueError("CostModel latencies must be >= 0 and bandwidth > 0")

    def all_reduce_us(self, nbytes: int, world_size: int) -> float:
        """Predicted time of one all_reduce of ``nbytes`` over ``world_size`` ranks."""
        n = max(world_size, 1)
        if n == 1:
            return 0.0
        wire = 2 * (n - 1) / n * nbytes
        return self.base_us + 2 * (n - 1) * self.hop_us + wire / (self.bandwidth_gbps * 1e3)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """What the fxcoalesce pipeline does to each compiled graph."""

    passes: tuple[str, ...] = DEFAULT_PASSES
    """Names of the passes to run, in order (see ``fxcoalesce.passes.PASSES``)."""
    disable: tuple[str, ...] = ()
    """Pass names to skip even if listed in ``passes``."""
    bucket_cap_mb: float = 512.0
    """Largest fused all_reduce, in MB; a level with more bytes is split into several buckets."""
    reassociate: bool = True
    """Allow rewrites that change floating-point summation order (linearity)."""
    strict: bool = False
    """Re-raise exceptions from passes instead of falling back to the unmodified graph."""
    codegen: str = "inductor"
    """Backend code generator: "inductor" (compile_fx_inner) or "eager" (run the FX graph)."""
    dump_dir: str | None = None
    """If set, write each graph before/after the pipeline and its report.json there."""
    cost: CostModel = field(default_factory=CostModel)
    """Cost model used for the report's predicted communication time."""

    def __post_init__(self):
        from fxcoalesce.passes import PASSES  # late: passes import this module

        unknown = [p for p in (*self.passes, *self.disable) if p not in PASSES]
        if unknown:
            raise ValueError(f"unknown pass name(s) {unknown}; known: {sorted(PASSES)}")
        if self.bucket_cap_mb <= 0:
            raise ValueError("bucket_cap_mb must be > 0")
        if self.codegen not in ("inductor", "eager"):
            raise ValueError(f"codegen must be 'inductor' or 'eager', not {self.codegen!r}")

    @property
    def enabled_passes(self) -> tuple[str, ...]:
        return tuple(p for p in self.passes if p not in self.disable)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)
