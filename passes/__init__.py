"""The fxcoalesce passes, one file each, in one registry.

A pass is ``name_pass(gm, *, cfg) -> PassResult``: it rewrites ``gm`` in place, keeps
``node.meta["val"]`` right on every node it creates, and never changes what the graph
computes (except floating-point summation order where ``cfg.reassociate`` allows it).
"""

from __future__ import annotations

from .bucket import bucket_pass
from .linearity import linearity_pass
from .result import PassResult
from .schedule import schedule_pass

PASSES = {
    "linearity": linearity_pass,
    "bucket": bucket_pass,
    "schedule": schedule_pass,
}



def check_config(cfg) -> None:
    """Raise ``ValueError`` if ``cfg`` names a pass that does not exist."""
    unknown = [p for p in (*cfg.passes, *cfg.disable) if p not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass name(s) {unknown}; known: {sorted(PASSES)}")


__all__ = ["PASSES", "PassResult", "bucket_pass", "check_config", "linearity_pass",
           "schedule_pass"]
