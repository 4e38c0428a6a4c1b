"""What a pass returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Bucket:
    """One fused all_reduce: the member collectives it replaced."""

    members: list[str]
    """Names of the collectives it replaced."""
    nbytes: int
    """Bytes the new collective reduces (size hints for symbolic sizes): for "cat" the
    members' sum, for "sum" one member's, for "slice" the slice's."""
    level: int
    key: str
    collective: str
    """Name of the new all_reduce node."""
    kind: str = "cat"
    """"cat": members concatenated into one buffer (bucket pass); "sum": their partial sums
    added before one reduction (linearity pass), which also cuts the bytes; "slice": one
    all_reduce that reduces only the slice its consumer reads (slice pass)."""


@dataclass(slots=True)
class PassResult:
    """Outcome of one pass: whether it changed the graph, what it built, what it left alone."""

    changed: bool = False
    buckets: list[Bucket] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    """Per candidate group: what the cost model chose and the predicted alternatives
    (``passes.decide``)."""
    warnings: list[str] = field(default_factory=list)
