"""The fxcoalesce passes, one file each, in one registry.

A pass is ``name_pass(gm, *, cfg) -> PassResult``: it rewrites ``gm`` in place, keeps
``node.meta["val"]`` right on every node it creates, and never changes what the graph
computes (except floating-point summation order where ``cfg.reassociate`` allows it).
"""

from __future__ import annotations

from .bucket import bucket_pass
from .result import PassResult
from .schedule import schedule_pass

PASSES = {
    "bucket": bucket_pass,
    "schedule": schedule_pass,
}

__all__ = ["PASSES", "PassResult", "bucket_pass", "schedule_pass"]
