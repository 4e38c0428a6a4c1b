"""What fxcoalesce knows of torch releases that its choices depend on. Torch is imported
only when a version is read (the CLI reads these names before it imports torch)."""

from __future__ import annotations

COMM_REORDER_RIGHT_FROM = (2, 14)
"""The first torch whose Inductor comm reordering passes (``raise_comms``, ``sink_waits``)
keep KV-cache writes in order; before, they ran a write after the read that needed it
(kimi-k2-tiny's logits off by ~2). The canary:
``tests/test_ranks.py::test_inductor_comm_reorder_passes_right_from_2_14``. Measured on
2.11.0 and 2.13.0 (sessions 13-14, that canary's step on 2 gloo ranks, each pass alone and all
three, with and without the run-time tags): through fxcoalesce, i.e. with
:func:`keep_mutation_renames` around the compile, every pass gives right logits (3.5e-6);
without it 2.31 off (2.13: all three passes; 2.11: ``sink_waits`` and
``reorder_compute_for_overlap``, ``raise_comms`` right): the same lost edge, not the passes.
They stay off before 2.14 for now: the bench's plain-Inductor variant ``inductor-reorder``
shares this gate and has no backport, and their time on 2.11's GPUs is unmeasured
(benchmarks/NOTES.md, session 14)."""

COMM_REORDER_PASSES = ("sink_waits", "raise_comms", "reorder_compute_for_overlap")

LOCALITY_REORDER_RIGHT_FROM = (2, 15)
"""The first torch where plain Inductor compiles the TP-2 speculative step right: on torch
2.11 and 2.13 (CPU, 2 gloo ranks) the compiled step of an 8-, 12- or 30-layer llama returned
wrong captured hidden states (off by 2-6), with plain ``backend="inductor"``; with
``reorder_for_locality`` off, right, but that pass only changes which fusions are tried. The
cause is :data:`MUTATION_RENAMES_KEPT_FROM`'s bug, which fxcoalesce's backend works around
(:func:`keep_mutation_renames`). The canary (plain Inductor, strict xfail before 2.15):
``tests/test_eagle3_static.py::test_compiled_step_tp2_hidden_matches_eager`` (slow)."""

MUTATION_RENAMES_KEPT_FROM = (2, 15)
"""The first torch whose Inductor scheduler keeps a node's mutation renames when the CPU
backend recomputes the node's loop body to fuse it (pytorch/pytorch#185873,
``SchedulerNode.recompute_size_and_body``). Before, a node that read an in-place
``all_reduce_``'s result (the wait's ``MutationOutput``, say ``buf185`` for ``buf181``) and
was re-indexed to fuse with a node of another loop shape (``CppScheduling.fuse``:
``_align_compatible_range_nodes``; e.g. ``[288]`` with the ``[4, 72]`` copy into a ``cat``
slot) read ``buf181`` again: its edge to the all_reduce and the wait was lost, and the fused
kernel could run before them, reading the rank's partial sum (the TP-2 speculative step's
hidden states off by 2-6; the same loss for any in-place mutation, e.g. the KV-cache
``index_copy_``)."""


def keep_mutation_renames():
    """A context manager: inside it, Inductor's ``SchedulerNode.recompute_size_and_body``
    keeps the node's mutation renames and fake dependencies (pytorch/pytorch#185873, backported)
    where this torch loses them (before :data:`MUTATION_RENAMES_KEPT_FROM`); elsewhere it
    changes nothing."""
    import contextlib

    if torch_version() >= MUTATION_RENAMES_KEPT_FROM:
        return contextlib.nullcontext()
    return _kept_mutation_renames()


def _kept_mutation_renames():
    import contextlib

    from torch._inductor import scheduler
    from torch._inductor.dependencies import StarDep, WeakDep
    from torch.utils._ordered_set import OrderedSet

    node_class = scheduler.SchedulerNode
    original = node_class.__dict__["recompute_size_and_body"]

    def recompute_size_and_body(self, *args, **kwargs):
        fake = OrderedSet(dep for dep in self.read_writes.reads
                          if isinstance(dep, (WeakDep, StarDep)))
        original(self, *args, **kwargs)
        renames = getattr(self, "mutation_renames", None) or {}
        if fake or renames:  # as torch 2.15 does
            read_writes = self.read_writes.with_read(fake) if fake else self.read_writes
            self.set_read_writes(read_writes.rename(renames))

    recompute_size_and_body.__wrapped__ = original

    @contextlib.contextmanager
    def patched():
        node_class.recompute_size_and_body = recompute_size_and_body
        try:
            yield
        finally:
            node_class.recompute_size_and_body = original

    return patched()


CONTROL_DEPS_FROM = (2, 13)
"""The first torch whose Inductor compiles the ``control_deps`` HOP that ``graph_order.pin_order``
puts around a node of the split's staggered order: on 2.11 ``compile_fx_inner`` fails ("could
not find kernel for HigherOrderOperator control_deps at DispatchKey.AutogradCPU",
tests/test_split.py::test_generated_code_keeps_the_stagger, CPU); right on 2.13 and 2.15.
2.12 is unmeasured and kept out. Before, the order is left unpinned: right values, and
Inductor may undo part of the stagger."""


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
