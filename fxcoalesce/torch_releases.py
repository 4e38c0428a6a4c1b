"""What fxcoalesce knows of torch releases that its choices depend on. Torch is imported
only when a version is read (the CLI reads these names before it imports torch)."""

from __future__ import annotations

COMM_REORDER_RIGHT_FROM = (2, 14)
"""The first torch whose Inductor comm reordering passes (``raise_comms``, ``sink_waits``)
keep KV-cache writes in order; before, they ran a write after the read that needed it
(kimi-k2-tiny's logits off by ~2). The canary:
``tests/test_ranks.py::test_inductor_comm_reorder_passes_right_from_2_14``."""

COMM_REORDER_PASSES = ("sink_waits", "raise_comms", "reorder_compute_for_overlap")


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def comm_reorder_options() -> dict:
    """Inductor's comm reordering passes, as ``torch.compile`` options, where they are right
    (torch 2.14+); {} before."""
    if torch_version() < COMM_REORDER_RIGHT_FROM:
        return {}
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": list(COMM_REORDER_PASSES)}
