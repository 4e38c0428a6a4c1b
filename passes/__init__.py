"""The fxcoalesce passes, one file each, in one registry.

A pass is ``name_pass(gm, *, cfg) -> PassResult``: it rewrites ``gm`` in place, keeps
``node.meta["val"]`` right on every node it creates, and never changes what the graph
computes (except floating-point summation order where ``cfg.reassociate`` allows it).
"""

from __future__ import annotations

from dataclasses import replace

from fxcoalesce.config import Config

from .bucket import bucket_pass
from .linearity import linearity_pass
from .result import PassResult
from .schedule import schedule_pass
from .slice import slice_pass

PASSES = {
    "slice": slice_pass,
    "linearity": linearity_pass,
    "bucket": bucket_pass,
    "schedule": schedule_pass,
}


def check_config(cfg) -> None:
    """Raise ``ValueError`` if ``cfg`` names a pass that does not exist."""
    unknown = [p for p in (*cfg.passes, *cfg.disable) if p not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass name(s) {unknown}; known: {sorted(PASSES)}")


RANK_INVARIANT_OFF = ("slice",)
"""Passes whose rewrite rests on facts one rank's graph cannot check; off wherever ranks
cannot compare their collectives at the first call (see ``compiler``)."""


def rank_invariant(cfg: Config) -> Config:
    """``cfg`` without the choices one rank cannot make alone: no cost-model choices (every
    group merges) and no pass in ``RANK_INVARIANT_OFF``. What the backend falls back to when
    ranks disagree, and what ``inductor_pass()`` always runs."""
    return replace(cfg, slack_aware=False,
                   disable=tuple(dict.fromkeys((*cfg.disable, *RANK_INVARIANT_OFF))))

__all__ = ["PASSES", "PassResult", "RANK_INVARIANT_OFF", "bucket_pass", "check_config",
           "linearity_pass", "rank_invariant", "schedule_pass", "slice_pass"]
