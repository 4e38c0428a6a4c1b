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
  and runs the program's own order where the ranks settle on it (:class:`ProgramOrder`:
  the Dynamo graph run eagerly).
- **A peer re-cut or recompiled the stretch alone**: seen only at run time, by the tags
  (``passes.tag``); their check raises on every rank of the pairing. The wrapper turns the
  check's error into :class:`~fxcoalesce.CollectiveMismatchError` where it surfaces
  (on CPU; on CUDA a device-side assert stops the process).

What the wrapper costs a call: one attribute read and an identity comparison, and a
``try`` (``benchmarks/NOTES.md``: measured).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .agreement import ladder
from .exchange import RETIRED, family
from .rank_check import CollectiveMismatchError

log = logging.getLogger("fxcoalesce")
REMEDY = (". Keep graph breaks alike on every rank (a print on one rank: "
          "torch._dynamo.config.reorderable_logging_functions.add(print)), or compile such a "
          "program with Config(passes=('schedule',)); see docs/rank-agreement.md")


LIMIT_HIT = re.compile(r"^torch\._dynamo hit config\.(\w+) \((\d+)\)\s+function: '([^']+)' "
                       r"\((.+):(\d+)\)")
"""Dynamo's warning when it stops compiling a function and runs it uncompiled."""


class _RecompileLimit(logging.Handler):
    """Dynamo's recompile limit, reached on this rank for a function the ranks agreed to
    run rewritten: running it uncompiled would issue the program's own collectives, untagged,
    where the peers issue the rewrite (a transport abort or wrong values). Raised on this
    rank from Dynamo's warning (Dynamo lets it through, before the frame runs), after a
    note in the store that the peers' wrapper turns into the same error."""

    def emit(self, record: logging.LogRecord) -> None:
        m = LIMIT_HIT.match(record.getMessage())
        if m is None or not dist.is_initialized():
            return
        from .exchange import process_env

        limit, value, name, path, line = m.groups()
        fam = family(f"{name}@{os.path.basename(path)}:{line}")
        try:
            env = process_env()
        except Exception:  # no store to read: nothing agreed here
            return
        if fam not in env.rewritten:
            return
        why = (f"rank {dist.get_rank()} reached Dynamo's {limit} ({value}) for {name}, which "
               "the ranks agreed to run rewritten, and would run it uncompiled (its "
               "collectives then differ from its peers')")
        env.exchange.stop(why)
        _stop_peers(f"{name}@{os.path.basename(path)}:{line}")
        raise CollectiveMismatchError(
            f"fxcoalesce: {why}. Make the value that recompiles {name} the same on every rank, "
            f"raise torch._dynamo.config.{limit}, or compile it with "
            "Config(passes=('schedule',))")


def _stop_peers(frame: str) -> None:
    """Send what ``frame``'s tagged graph opens with, with a tag no rank can send (every bit
    and its complement set; cleared under min): the peers, which run that graph, pair it
    with their first tagged all_reduce and fail its check at once, instead of waiting for
    this rank until the group's timeout."""
    import torch

    from fxcoalesce.passes.tag import TAG_BITS

    from .graph_compile import OPENS

    if frame not in OPENS:
        return
    group, op, dtype, numel, device = OPENS[frame]
    pg = dist.distributed_c10d._resolve_process_group(group)
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN}
    # numel: the tag's included. Every tag slot 1 (0 under min): each bit's pair then
    # reduces to 1 and 1 (0 and 0), which no check passes
    poison = torch.zeros(numel, dtype=dtype, device=device)
    poison[-2 * TAG_BITS:] = 0 if op == "min" else 1
    try:
        dist.all_reduce(poison, ops[op], group=pg)
    except Exception:  # the peers stopped first, or the group is gone: they know
        pass


def watch_recompile_limit() -> None:
    """Attach :class:`_RecompileLimit` to Dynamo's logger (again, where torch's logging set-up
    replaced its handlers)."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(h, _RecompileLimit) for h in logger.handlers):
        logger.addHandler(_RecompileLimit())


def stopped_peers() -> str | None:
    """Why a peer stopped on purpose (:class:`_RecompileLimit`), if one did: read from the
    store only after a collective failed."""
    try:
        from .exchange import process_env

        return process_env().exchange.stopped() if dist.is_initialized() else None
    except Exception:  # the store is gone with the peer: nothing more to say
        return None


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
        self.family = family(job.frame) if job.frame else None
        self.retirable = bool(self.family and graphs) and any(
            g.tagged or (g.sequences and g.step != len(ladder(self.cfg)) - 1) for g in graphs)
        watch_recompile_limit()

    def __call__(self, *args, **kwargs):
        if default_group() is not self.group:
            self._again()
        if self.retirable and self.family in RETIRED:
            self._retire()
        try:
            return self.run(*args, **kwargs)
        except RuntimeError as e:
            from fxcoalesce.passes.tag import MESSAGE_START

            if MESSAGE_START in str(e) and REMEDY not in str(e):
                why = stopped_peers()  # a peer that stopped on purpose says why
                raise CollectiveMismatchError(
                    str(e) + (f"; {why}" if why else "") + REMEDY) from None
            if not isinstance(e, CollectiveMismatchError) and (why := stopped_peers()):
                raise CollectiveMismatchError(f"fxcoalesce: {why}; this rank's collective "
                                              f"could not complete ({e})") from None
            raise

    def _retire(self) -> None:
        """The ranks saw this graph's function cut in two ways and retired its rewritten
        graphs together (``exchange``, "cut varies"): run the program's own order, untagged,
        as the function's later graphs do on every rank."""
        log.warning("fxcoalesce[%s]: its function is cut into graphs in more than one way, so "
                    "every rank runs its rewritten graphs in the program's own order from now "
                    "on (eagerly)", self.name)
        self.retirable = False
        self.run = ProgramOrder(self.gm, self.name)

    def _again(self) -> None:
        """Agree again in the new default group's store on every graph of this compile: the
        ranks can run this one's compiled step only where all of them can."""
        from .agreement import ladder
        from .exchange import agree_graph, announce

        self.group = default_group()
        if self.group is None:  # no group now: the collectives fail as plain's would
            return
        announce()  # this rank's process and heartbeat, in the new store
        steps = ladder(self.cfg)
        program_only, tag = False, 0
        for g in self.graphs:
            if not g.sequences:  # not agreed on (no peers then): nothing to re-agree
                continue
            if not g.tagged and list(g.sequences[g.step]) == list(g.program):
                continue  # the program's own order, untagged: it pairs with what peers run
            outcome = agree_graph(self.name, self.cfg, steps, g.program,
                                  offered(g.sequences, g.step), g.workspaces,
                                  check_ranks=False, **self.origin)
            log.warning("fxcoalesce[%s]: the default process group was made anew since this "
                        "graph was compiled; the ranks agreed again: %s (%s)", self.name,
                        outcome.agreement.how, steps[outcome.step].label)
            if outcome.step != g.step:
                program_only = True
                tag = outcome.tag if outcome.tagged else 0
        self.run = ProgramOrder(self.gm, self.name, tag) if program_only else self.compiled


def offered(sequences: list, step: int) -> list:
    """What a rank that compiled ``step`` of a graph can run without compiling again: that
    step and the program's own order (the last); every other step's sequence is replaced by
    one no peer can match, so the ranks agree on one of those two."""
    last = len(sequences) - 1
    return [seq if i in (step, last) else [(None, f"not compiled here: {i}")]
            for i, seq in enumerate(sequences)]


class ProgramOrder:
    """The Dynamo graph run eagerly: what a rank runs where the ranks agreed again on the
    program's own order for a graph it compiled otherwise. Tagged like a compiled graph of
    that decision (``tag``: its first all_reduce in each group; 0: untagged, as every graph
    of the program's order that no rank rewrote, ``passes.tag``)."""

    def __init__(self, gm, name: str, tag: int = 0):
        self.gm, self.name, self.tag = gm, name, tag

    def __call__(self, *args, **kwargs):
        if not self.tag:
            return self.gm(*args, **kwargs)
        with _FirstTags(self.name, self.tag):
            return self.gm(*args, **kwargs)


class _FirstTags(TorchDispatchMode):
    """Tag the first all_reduce of each group as ``passes.tag`` does, check it before
    anything more is issued."""

    def __init__(self, name: str, tag: int):
        super().__init__()
        self.name, self.tag, self.seen = name, tag, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        from fxcoalesce.passes.tag import agrees, bits, message, taggable_value

        kwargs = kwargs or {}
        c10d = torch.ops._c10d_functional
        if func is not c10d.all_reduce.default or args[2] in self.seen:
            return func(*args, **kwargs)
        x, op, group = args
        self.seen.add(group)
        world = dist.distributed_c10d._resolve_process_group(group).size()
        if not taggable_value(str(op), x.dtype, world):
            return func(*args, **kwargs)
        sent = torch.tensor(bits(self.tag), dtype=x.dtype, device=x.device)
        n = x.numel()
        out = c10d.wait_tensor.default(func(torch.cat([x.reshape(-1), sent]), op, group))
        if not agrees(out[n:], self.tag):
            raise CollectiveMismatchError(message(self.name, self.tag) + REMEDY)
        return out[:n].view(x.shape).clone()
