"""What a graph the ranks agreed on does at every call, before it issues anything.

    compiled = Guarded(compiled, graphs, job, gm)   # graph_compile wraps what it compiled
    out = compiled(*args)

Two things can change under a compiled graph between calls, without its backend hearing of
it (``agreement`` has the argument this completes):

- **The process group is made anew** (``destroy_process_group`` and a new default group):
  Dynamo's guards pass, so the graph runs again, on the new group, with an agreement made
  in the old store. The wrapper sees it (the default group is another object: one
  attribute read a call) and agrees again in the new store before issuing anything: it
  proposes only what it can run now (the step it compiled, or the program's own order),
  and runs the program's own order, tagged like a compiled one, where the ranks settle on
  it (:class:`ProgramOrder`: the Dynamo graph run eagerly).
- **A peer re-cut or recompiled the stretch alone**: seen only at run time, by the tags
  (``passes.tag``); their check raises on every rank of the pairing. The wrapper turns the
  check's error into :class:`~fxcoalesce.CollectiveMismatchError` where it surfaces
  (on CPU; on CUDA a device-side assert stops the process).

What the wrapper costs a call: one attribute read and an identity comparison, and a
``try`` (``benchmarks/NOTES.md``: measured).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .rank_check import CollectiveMismatchError

log = logging.getLogger("fxcoalesce")
REMEDY = (". Keep graph breaks alike on every rank (a print on one rank: "
          "torch._dynamo.config.reorderable_logging_functions.add(print)), or compile such a "
          "program with Config(passes=('schedule',)); see docs/rank-agreement.md")


def default_group():
    """The default process group object (None when none is up): what identifies the
    group, and its store, that a graph agreed in."""
    return dist.distributed_c10d._world.default_pg if dist.is_initialized() else None


class Guarded:
    """A compiled graph whose ranks agreed on it (``graphs``: the ``graph_compile.Agreed``
    of each of its ATen graphs), re-agreed when the default process group is made anew."""

    def __init__(self, compiled: Callable, graphs: list, job, gm):
        """``job``: the ``graph_compile.GraphCompile`` that compiled it (its config, name and
        where its graph comes from); ``gm``: its Dynamo graph."""
        self.compiled, self.graphs, self.cfg, self.name = compiled, graphs, job.cfg, job.name
        self.origin = {"frame": job.frame, "cut": job.cut, "guards": job.guards}
        self.gm = gm
        self.group = default_group()
        self.run = compiled

    def __call__(self, *args, **kwargs):
        if default_group() is not self.group:
            self._again()
        try:
            return self.run(*args, **kwargs)
        except RuntimeError as e:
            from fxcoalesce.passes.tag import MESSAGE_START

            if MESSAGE_START in str(e) and REMEDY not in str(e):
                raise CollectiveMismatchError(str(e) + REMEDY) from None
            raise

    def _again(self) -> None:
        """Agree again in the new default group's store on every graph of this compile: the
        ranks can run this one's compiled step only where all of them can."""
        from .agreement import ladder
        from .exchange import agree_graph

        self.group = default_group()
        if self.group is None:  # no group now: the collectives fail as plain's would
            return
        steps = ladder(self.cfg)
        program_only = False
        for g in self.graphs:
            if not g.sequences:  # not agreed on (no peers then): nothing to re-agree
                continue
            outcome = agree_graph(self.name, self.cfg, steps, g.program,
                                  offered(g.sequences, g.step), g.workspaces,
                                  check_ranks=False, **self.origin)
            log.warning("fxcoalesce[%s]: the default process group was made anew since this "
                        "graph was compiled; the ranks agreed again: %s (%s)", self.name,
                        outcome.agreement.how, steps[outcome.step].label)
            if outcome.step != g.step or self.cfg.run_checks != g.tagged:
                program_only = True
        self.run = (ProgramOrder(self.gm, self.name, self.cfg.run_checks) if program_only
                    else self.compiled)


def offered(sequences: list, step: int) -> list:
    """What a rank that compiled ``step`` of a graph can run without compiling again: that
    step and the program's own order (the last); every other step's sequence is replaced by
    one no peer can match, so the ranks agree on one of those two."""
    last = len(sequences) - 1
    return [seq if i in (step, last) else [(None, f"not compiled here: {i}")]
            for i, seq in enumerate(sequences)]


class ProgramOrder:
    """The Dynamo graph run eagerly, every all_reduce tagged as a compiled graph of the
    program's own order tags it (``passes.tag``; untagged without ``Config.run_checks``):
    what a rank runs where the ranks agreed again on the program's order for a
    graph it compiled otherwise."""

    def __init__(self, gm, name: str, tags: bool = True):
        self.gm, self.name, self.tags = gm, name, tags

    def __call__(self, *args, **kwargs):
        if not self.tags:
            return self.gm(*args, **kwargs)
        with _ProgramTags(self.name):
            return self.gm(*args, **kwargs)


class _ProgramTags(TorchDispatchMode):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from fxcoalesce.passes.tag import PROGRAM_TAG, SLOTS, expected, message, taggable_value

        kwargs = kwargs or {}
        c10d = torch.ops._c10d_functional
        if func is not c10d.all_reduce.default:
            return func(*args, **kwargs)
        x, op, group = args
        world = dist.distributed_c10d._resolve_process_group(group).size()
        if not taggable_value(str(op), x.dtype, world):
            return func(*args, **kwargs)
        tag = [PROGRAM_TAG, -PROGRAM_TAG] if SLOTS[str(op)] == 2 else [PROGRAM_TAG]
        sent = torch.tensor(tag, dtype=x.dtype, device=x.device)
        want = torch.tensor(expected(str(op), PROGRAM_TAG, world), dtype=x.dtype,
                            device=x.device)
        n = x.numel()
        out = c10d.wait_tensor.default(func(torch.cat([x.reshape(-1), sent]), op, group))
        data, tail = out[:n].view(x.shape).clone(), out[n:]
        if not torch.equal(tail, want):
            raise CollectiveMismatchError(message(self.name, str(op), PROGRAM_TAG) + REMEDY)
        return data
