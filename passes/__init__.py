"""The fxcoalesce passes, one file each, in one registry.

A pass is ``name_pass(gm, *, cfg) -> PassResult``: it rewrites ``gm`` in place, keeps
``node.meta["val"]`` right on every node it creates, and never changes what the graph
computes (except floating-point summation order where ``cfg.reassociate`` allows it).
"""

from __future__ import annotations

from dataclasses import replace

from fxcoalesce.config import Config

from .bucket import bucket_pass
from .fuse_norm import fuse_norm_pass
from .linearity import linearity_pass
from .lower import lower_pass
from .result import PassResult
from .schedule import schedule_pass
from .slice import slice_pass
from .split import split_pass

PASSES = {
    "slice": slice_pass,
    "linearity": linearity_pass,
    "bucket": bucket_pass,
    "split": split_pass,
    "fuse_norm": fuse_norm_pass,
    "lower": lower_pass,
    "schedule": schedule_pass,
}


def check_config(cfg) -> None:
    """Raise ``ValueError`` if ``cfg`` names a pass that does not exist."""
    unknown = [p for p in (*cfg.passes, *cfg.disable) if p not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass name(s) {unknown}; known: {sorted(PASSES)}")


SEQUENCE_PRESERVING = ("schedule",)
"""Passes that never change the collective sequence: they only move nodes, and keep the
collectives in their current order (``graph_order.reorder`` chains them)."""

READS_COMPUTE = ("slice", "linearity", "split", "fuse_norm")
"""Passes whose matches read compute around the collectives (the slice after a wait, the adds
after the waits, the ops around an all_reduce that keep a token split, the add and norm after
a wait), which can differ between ranks."""


def changes_sequence(cfg: Config) -> bool:
    """Can the pipeline of ``cfg`` issue another collective sequence than the program's?"""
    return any(p not in SEQUENCE_PRESERVING for p in cfg.enabled_passes)


def without_compute_choices(cfg: Config) -> Config:
    """``cfg`` without the choices that read compute: no cost-model choices (every group of
    independent all_reduces merges) and no pass in ``READS_COMPUTE``. What is left rests on
    collective-to-collective dependencies alone, which still can differ between ranks (a
    branch on the rank), so ranks still compare (``agreement``)."""
    return replace(cfg, slack_aware=False,
                   disable=tuple(dict.fromkeys((*cfg.disable, *READS_COMPUTE))))


def program_order(cfg: Config) -> Config:
    """``cfg`` with only the passes in ``SEQUENCE_PRESERVING``: the program's own collective
    sequence, the same on every rank whenever the program's is. The last fallback."""
    off = [p for p in PASSES if p not in SEQUENCE_PRESERVING]
    return replace(cfg, slack_aware=False, disable=tuple(dict.fromkeys((*cfg.disable, *off))))


__all__ = ["PASSES", "PassResult", "READS_COMPUTE", "SEQUENCE_PRESERVING", "bucket_pass",
           "changes_sequence", "check_config", "fuse_norm_pass", "linearity_pass", "lower_pass",
           "program_order", "schedule_pass", "slice_pass", "split_pass",
           "without_compute_choices"]
