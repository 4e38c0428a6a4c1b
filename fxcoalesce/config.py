"""Configuration of the fxcoalesce pipeline (plain data: no torch, no passes imported).

Pass names are checked against the registry by ``fxcoalesce.passes.check_config``, which
every entry point calls, so a typo fails when the backend is made, not at the first compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_PASSES = ("linearity", "bucket", "schedule")


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
        if not all(math.isfinite(v) for v in (self.base_us, self.hop_us, self.bandwidth_gbps)):
            raise ValueError("CostModel values must be finite numbers")
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
    """Allow rewrites that change floating-point summation order: the linearity pass adds
    partial sums before one all_reduce instead of adding several reduced values (fewer
    launches and bytes). ``False`` keeps results bit-exact with the unrewritten graph."""
    strict: bool = False
    """Re-raise exceptions from passes instead of falling back to the unmodified graph."""
    codegen: str = "inductor"
    """Backend code generator: "inductor" (compile_fx_inner) or "eager" (run the FX graph)."""
    dump_dir: str | None = None
    """If set, write each graph before/after the pipeline and its report.json there."""
    check_ranks: bool = False
    """On the first run of each compiled graph, compare the sequence of collectives it issues
    across the ranks of each group it uses, and raise naming the first difference before any
    data collective runs (the ``FXCOALESCE_CHECK_RANKS=1`` environment variable turns it on
    in the backend). Costs one small all_gather per group, once per graph."""
    cost: CostModel = field(default_factory=CostModel)
    """Cost model used for the report's predicted communication time."""

    def __post_init__(self):
        if isinstance(self.passes, str) or isinstance(self.disable, str):
            raise ValueError("passes and disable are tuples of pass names, e.g. ('bucket',)")
        if not (isinstance(self.bucket_cap_mb, (int, float)) and math.isfinite(self.bucket_cap_mb)
                and self.bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a finite number > 0, not "
                             f"{self.bucket_cap_mb!r}")
        if self.codegen not in ("inductor", "eager"):
            raise ValueError(f"codegen must be 'inductor' or 'eager', not {self.codegen!r}")

    @property
    def enabled_passes(self) -> tuple[str, ...]:
        return tuple(p for p in self.passes if p not in self.disable)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)
