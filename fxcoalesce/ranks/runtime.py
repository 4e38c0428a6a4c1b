"""What a graph the ranks agreed on does at every call, before it issues anything
(``Guarded``, made by ``graph_compile``): a process group made anew (one attribute read a
call) makes it agree again in the new store, offering only what it can run now (its step, or
the program's own order: :class:`ProgramOrder`, the Dynamo graph run eagerly); a retired
function runs the program's order for good; a failed tag check surfaces as
``CollectiveMismatchError`` (on CUDA a device-side assert stops the process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..checked import Firsts, taggable_value
from ..errors import CollectiveMismatchError
from .agreement import PROCESS, agree_graph, family, ladder, process_env
from .hooks import FIX, IN_GRAPH, watch_dynamo
from .tag import MESSAGE_START, agrees, bits, message

log = logging.getLogger("fxcoalesce")


def default_group():
    """The default process group object (None when none is up)."""
    return dist.distributed_c10d._world.default_pg if dist.is_initialized() else None


class Guarded:
    """A compiled graph whose ranks agreed on it (``graphs``: the ``ranks.compile.Agreed`` of
    each of its ATen graphs)."""

    def __init__(self, compiled: Callable, graphs: list, job, gm):
        """``job``: the ``graph_compile.GraphCompile`` that compiled it; ``gm``: its Dynamo
        graph."""
        self.compiled, self.graphs, self.cfg, self.name = compiled, graphs, job.cfg, job.name
        self.origin = {"frame": job.frame, "cut": job.cut, "guards": job.guards}
        self.gm, self.group, self.run = gm, default_group(), compiled
        self.family = family(job.frame) if job.frame else None
        self.retired = False
        self.retirable = bool(self.family and graphs) and any(
            g.tagged or (g.sequences and g.step != len(ladder(self.cfg)) - 1) for g in graphs)
        watch_dynamo()

    def __call__(self, *args, **kwargs):
        if default_group() is not self.group:
            self._again()
        if self.retirable and self.family in PROCESS.retired:
            self._retire()
        IN_GRAPH.depth = getattr(IN_GRAPH, "depth", 0) + 1
        try:
            return self.run(*args, **kwargs)
        except RuntimeError as e:
            if MESSAGE_START in str(e) and FIX not in str(e):
                raise CollectiveMismatchError(f"{e}. {FIX}") from None
            raise
        finally:
            IN_GRAPH.depth -= 1

    def _retire(self) -> None:
        log.warning("fxcoalesce[%s]: every rank runs its function's rewritten graphs in the "
                    "program's own order from now on (eagerly): they ran it uncompiled alike, "
                    "or cut it into graphs in more than one way", self.name)
        self.retirable, self.retired = False, True
        self.run = ProgramOrder(self.gm, self.name)

    def _again(self) -> None:
        """Agree again in the new default group's store on every graph of this compile."""
        self.group = default_group()
        if self.group is None:  # no group now: the collectives fail as plain's would
            return
        process_env()
        if self.retired or (self.retirable and self.family in PROCESS.retired):
            return
        steps = ladder(self.cfg)
        program_only, tag = False, 0
        for g in self.graphs:
            if not g.sequences or (not g.tagged and list(g.sequences[g.step]) == list(g.program)):
                continue  # not agreed on, or the program's own order untagged: it pairs
            outcome = agree_graph(self.name, self.cfg, steps, g.program,
                                  offered(g.sequences, g.step), g.workspaces,
                                  check_ranks=False, **self.origin)
            log.warning("fxcoalesce[%s]: the default process group was made anew since this "
                        "graph was compiled; the ranks agreed again: %s (%s)", self.name,
                        outcome.agreement.how, steps[outcome.step].label)
            if outcome.step != g.step:
                program_only, tag = True, outcome.tag if outcome.tagged else 0
        self.run = ProgramOrder(self.gm, self.name, tag) if program_only else self.compiled


def offered(sequences: list, step: int) -> list:
    """What a rank that compiled ``step`` can run without compiling again: that step and the
    program's own order; every other step is replaced by one no peer can match."""
    last = len(sequences) - 1
    return [seq if i in (step, last) else [(None, f"not compiled here: {i}")]
            for i, seq in enumerate(sequences)]


class ProgramOrder:
    """The Dynamo graph run eagerly: the program's own order, where the ranks agreed again on
    it for a graph compiled otherwise; ``tag``: carried as a compiled graph of that decision
    carries it (0: none)."""

    def __init__(self, gm, name: str, tag: int = 0):
        self.gm, self.name, self.tag = gm, name, tag

    def __call__(self, *args, **kwargs):
        if not self.tag:
            return self.gm(*args, **kwargs)
        with _FirstTags(self.name, self.tag):
            return self.gm(*args, **kwargs)


class _FirstTags(TorchDispatchMode):
    """Tag each group's checked first all_reduce (``checked.Firsts``), checked before
    anything more is issued."""

    def __init__(self, name: str, tag: int):
        super().__init__()
        self.name, self.tag, self.firsts = name, tag, Firsts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        kwargs = kwargs or {}
        c10d = torch.ops._c10d_functional
        if getattr(func, "namespace", "") != "_c10d_functional" or func is c10d.wait_tensor.default:
            return func(*args, **kwargs)
        x, group = args[0], args[-1]
        is_ar = func is c10d.all_reduce.default
        world = dist.distributed_c10d._resolve_process_group(group).size()
        if not self.firsts.opens(group, is_ar, is_ar and taggable_value(
                str(args[1]), x.dtype, world), x):
            return func(*args, **kwargs)
        n = x.numel()
        sent = torch.tensor(bits(self.tag), dtype=x.dtype, device=x.device)
        out = c10d.wait_tensor.default(func(torch.cat([x.reshape(-1), sent]), args[1], group))
        if not agrees(out[n:], self.tag):
            raise CollectiveMismatchError(f"{message(self.name, self.tag)}. {FIX}")
        return out[:n].view(x.shape).clone()
