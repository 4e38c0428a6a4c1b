"""What fxcoalesce knows of torch releases that its choices depend on. Torch is imported
only when a version is read (the CLI reads these names before it imports torch)."""

from __future__ import annotations

COMM_REORDER_RIGHT_FROM = (2, 14)
"""The first torch whose Inductor comm reordering passes (``raise_comms``, ``sink_waits``)
keep KV-cache writes in order; before, they ran a write after the read that needed it
(kimi-k2-tiny's logits off by ~2). The canary:
``tests/test_ranks.py::test_inductor_comm_reorder_passes_right_from_2_14``."""

COMM_REORDER_PASSES = ("sink_waits", "raise_comms", "reorder_compute_for_overlap")

LOCALITY_REORDER_RIGHT_FROM = (2, 15)
"""The first torch where Inductor's ``reorder_for_locality`` keeps graphs with collectives
right: on torch 2.11 and 2.13 (CPU, 2 gloo ranks) the compiled speculative step of a 12- or
30-layer llama returned wrong captured hidden states (off by 2-6; its tokens, and the KV
caches, right), with plain ``backend="inductor"`` as with fxcoalesce; with the pass off,
right; torch 2.15 right with it on. Not checked on 2.14. Not worked around yet: turning
the pass off for graphs with collectives hid fewer kernels under neox-tiny's all_reduces
than plain Inductor (tests/test_codegen.py; benchmarks/NOTES.md, session 12). The canary:
``tests/test_eagle3_static.py::test_compiled_step_tp2_hidden_matches_eager`` (slow)."""


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


def locality_reorder_unsafe() -> bool:
    """Whether this torch's ``reorder_for_locality`` can make graphs with collectives wrong."""
    return torch_version() < LOCALITY_REORDER_RIGHT_FROM
