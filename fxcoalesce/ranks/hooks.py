"""The hooks that hear Dynamo, and every call of an agreed graph (part 3 of the package
docstring's argument), in this rank's thread.

Dynamo: each frame it is done with is noted in the store's log (``store.note``); a frame it
runs uncompiled where this rank runs the function rewritten is watched for that call
(:class:`Uncompiled`), its collectives seen through the functional ops' packets and
``dist``'s functions, swapped for that call and thread only (a dispatch mode would make
Dynamo skip every frame it meets, for good). A graph the ranks agreed on (:class:`Guarded`,
made by ``graph_compile``): a process group made anew (one attribute read a call) makes it
agree again in the new store, offering only what it can run now (its step, or the program's
own order: :class:`ProgramOrder`, the Dynamo graph run eagerly); a retired function runs the
program's order for good; a failed tag check surfaces as ``CollectiveMismatchError`` (on CUDA
a device-side assert stops the process).
"""

from __future__ import annotations

import _thread
import logging
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..checked import Firsts, taggable_value
from ..errors import CollectiveMismatchError
from ..meta import is_torch_file
from .agreement import PROCESS, agree_graph, code_key, family, ladder, positions, process_env
from .store import RESERVED_ID
from .tag import MESSAGE_START, agrees, bits, message

log = logging.getLogger("fxcoalesce")
SKIP_HOOK = "auto"
"""Where to hear Dynamo: ``"auto"``, its ``_handle_skip`` where this torch has one (2.13 on),
else ``CatchErrorsWrapper.__call__`` (2.11); ``"call"``, the latter always (tests)."""
_WATCHED: list = []
IN_GRAPH = _thread._local()
"""``depth`` > 0 while a compiled graph runs (:class:`Guarded`): its collectives are the
graph's own, never watched."""
FIX = ("Keep the function's graph breaks and recompiles alike on every rank (a log call on one "
       "rank: log outside the compiled function, or print, which Dynamo can move past the graph:"
       " torch._dynamo.config.reorderable_logging_functions.add(print); a value only one rank "
       "changes), or compile it with Config(passes=('schedule',)); see docs/rank-agreement.md")


def watch_dynamo() -> None:
    """Hear what Dynamo makes of every frame (once per process)."""
    from ..torch_internals import disabled

    if _WATCHED or not SKIP_HOOK or "skip-hook" in disabled():
        return
    from torch._dynamo import convert_frame

    wrapper = getattr(convert_frame, "CatchErrorsWrapper", None)
    if wrapper is None:  # not this torch's shape: nothing heard
        return
    orig = getattr(wrapper, "_handle_skip", None)
    skips = orig is not None and SKIP_HOOK == "auto"
    if skips:
        def _handle_skip(self, result, frame):
            _listen(result, frame, None)
            return orig(self, result, frame)

        wrapper._handle_skip = _handle_skip
        _WATCHED.append(("_handle_skip", orig))
    call = wrapper.__call__

    def __call__(self, frame, *args, **kwargs):  # torch 2.11: a skip is a result without code
        with _logging_reordered(frame.f_code):
            result = call(self, frame, *args, **kwargs)
        if not skips:
            _listen(result, frame, "no compiled code")
        return result

    wrapper.__call__ = __call__
    _WATCHED.append(("__call__", call))


def _logging_reordered(code):
    """Where this rank runs ``code``'s function rewritten, Dynamo compiles it again with
    ``print`` moved past the graph (``reorderable_logging_functions``): a print that only this
    rank reaches now (a flag it set) is then no re-cut, so the recompile issues what the ranks
    agreed ("decided before") instead of stopping them. Dynamo cannot move a logger's call."""
    from contextlib import nullcontext

    env = PROCESS
    if not env.rewritten or family(code_key(code)) not in env.rewritten - (
            env.retired):
        return nullcontext()
    from torch._dynamo import config

    return config.patch(reorderable_logging_functions={*config.reorderable_logging_functions,
                                                       print})


def _listen(result, frame, uncompiled: str | None) -> None:
    try:
        _heard(result, frame, uncompiled)
    except Exception:  # never break Dynamo: this rank goes on as without the hook
        log.exception("fxcoalesce: could not look at Dynamo's result for %s",
                      frame.f_code.co_name)


def _heard(result, frame, uncompiled: str | None) -> None:
    """What Dynamo made of ``frame``: uncompiled (a skip), or compiled only up to a graph
    break it cannot resume from (``partly``), goes to :func:`runs_uncompiled`."""
    reason = getattr(result, "skip_reason", None) or uncompiled
    code = getattr(getattr(result, "guarded_code", None), "code", None)
    if code is None and reason is not None:
        runs_uncompiled(frame, str(reason), result)
    elif code is not None and _runs_original(code, frame.f_code):
        runs_uncompiled(frame, "compiled only up to a graph break, the rest uncompiled")
    elif code is not None:
        _note(frame, "compiled")


def _note(frame, how: str):
    """Say in the store that Dynamo is done with ``frame`` here (``how``: "skipped" or
    "compiled"), and where this rank stands: a peer waiting for a graph of that function from
    that place, which this rank did not propose, stops waiting. The env, or None."""
    if (is_torch_file(frame.f_code.co_filename) or not dist.is_initialized()
            or PROCESS.exchange is None):  # (None: this process made no backend)
        return None
    try:
        if dist.get_backend() == "fake" or dist.get_world_size() < 2:
            return None
        env = process_env()  # a group made anew is joined here
        env.exchange.note({"fam": family(code_key(frame.f_code)), "pos": positions(),
                           "how": how})
        return env
    except Exception:  # the store went with a peer: its collectives fail as plain's would
        return None


def runs_uncompiled(frame, reason: str, result=None) -> None:
    """Dynamo runs ``frame`` uncompiled, this call at least, on this rank. Where this rank
    runs the function rewritten, for this call only (``result.apply_to_code``: Dynamo would
    skip the code for good, and its later uncompiled runs would pass unseen): the next call
    goes through Dynamo again, and runs a compiled graph where its guards pass (a call that
    raised the user's own exception at a shape its graphs do not have, then good input)."""
    env = None if "skipfiles" in reason else _note(frame, "skipped")
    fam = family(code_key(frame.f_code))
    if env is not None and fam in env.rewritten and fam not in env.retired:
        if result is not None and hasattr(result, "apply_to_code"):
            result.apply_to_code = False
        Uncompiled(frame, fam, _limit(frame.f_code) or reason).arm()


def _limit(code) -> str | None:
    """"it reached Dynamo's recompile_limit (N)" where ``code`` has that many compiled
    entries (Dynamo's own reason names no limit), else None."""
    from torch._dynamo import config, eval_frame

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    try:
        n = len(eval_frame._debug_get_cache_entry_list(code))
    except Exception:  # another torch's layout: the reason as Dynamo gives it
        return None
    limit = getattr(config, name, None)
    return f"it reached Dynamo's {name} ({limit})" if limit and n >= limit else None


_FUNCTIONAL = ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast", "all_reduce_coalesced",
               "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
_C10D = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather",
         "reduce_scatter_tensor", "all_to_all_single", "reduce", "barrier")
_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
        dist.ReduceOp.MIN: "min"}


class _Packet:
    """An op packet whose calls go to ``handler`` (its overloads, ``.default``, do not)."""

    def __init__(self, orig, handler):
        self._orig, self._handler = orig, handler

    def __call__(self, *args, **kwargs):
        return self._handler(self._orig, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._orig, name)


class Uncompiled:
    """One call of a function this rank runs rewritten, that Dynamo runs uncompiled here: its
    collectives watched until the frame returns (module docstring)."""

    def __init__(self, frame, fam: str, reason: str):
        self.code, self.fam, self.reason = frame.f_code, fam, reason
        self.thread = _thread.get_ident()
        self.firsts = Firsts()
        self.saved: list = []
        self.prev = self.live = None
        caller = sys._getframe(1)  # Dynamo hands over its own frame type: the Python frame
        while caller is not None and (is_torch_file(caller.f_code.co_filename)  # is the next
                                      or caller.f_code.co_filename == __file__):  # call of
            caller = caller.f_back  # the code; the caller's return closes the watch too
        self.caller = caller

    def arm(self) -> None:
        ns = torch.ops._c10d_functional
        for name in _FUNCTIONAL:
            if hasattr(ns, name):
                orig = getattr(ns, name)
                self.saved.append((ns, name, orig))
                setattr(ns, name, _Packet(orig, self._functional(name)))
        for mod in (dist, dist.distributed_c10d):
            for name in _C10D:
                if hasattr(mod, name):
                    orig = getattr(mod, name)
                    self.saved.append((mod, name, orig))
                    setattr(mod, name, self._c10d(name, orig))
        self.prev = sys.getprofile()
        sys.setprofile(self._profile)

    def close(self) -> None:
        for obj, name, orig in reversed(self.saved):
            setattr(obj, name, orig)
        self.saved = []
        if sys.getprofile() == self._profile:
            sys.setprofile(self.prev)

    def _profile(self, frame, event, arg) -> None:
        if self.prev is not None:
            self.prev(frame, event, arg)
        if self.live is None and event == "call" and frame.f_code is self.code:
            self.live = frame
        elif event == "return" and (frame is self.live or frame is self.caller):
            self.close()

    def _mine(self) -> bool:
        return _thread.get_ident() == self.thread and not getattr(IN_GRAPH, "depth", 0)

    def _functional(self, name):
        def handle(orig, *args, **kwargs):
            if not self._mine() or not self.saved:
                return orig(*args, **kwargs)
            x, group = args[0], args[-1]
            op = args[1] if name.startswith("all_reduce") and len(args) > 2 else ""
            if not _opens(self.firsts, group, name.startswith("all_reduce") and not
                          name.endswith("coalesced"), op, x):
                return orig(*args, **kwargs)
            out = torch.ops._c10d_functional.wait_tensor(
                orig(_tagged(x, RESERVED_ID), *args[1:], **kwargs))
            self._check(out[x.numel():], group)
            data = out[:x.numel()].view(x.shape)
            if name == "all_reduce_":
                return x.copy_(data)
            return data.clone()
        return handle

    def _c10d(self, name, orig):
        def handle(*args, **kwargs):
            if not self._mine() or not self.saved:
                return orig(*args, **kwargs)
            group = kwargs.get("group", args[2] if name == "all_reduce" and len(args) > 2
                               else None) or dist.group.WORLD
            gname = group.group_name
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
            op = _OPS.get(op, "") if name == "all_reduce" else ""
            if x is None or not _opens(self.firsts, gname, name == "all_reduce", op, x):
                return orig(*args, **kwargs)
            buf = _tagged(x, RESERVED_ID)
            orig(buf, op=args[1] if len(args) > 1 else kwargs.get("op", dist.ReduceOp.SUM),
                 group=group)
            self._check(buf[x.numel():], gname)
            x.copy_(buf[:x.numel()].view(x.shape))
            return _Done() if kwargs.get("async_op") else None
        return handle

    def _check(self, tail, group: str) -> None:
        if agrees(tail, RESERVED_ID):
            # every rank of the pairing runs it uncompiled here: its rewritten graphs retire
            PROCESS.retired.add(self.fam)
            PROCESS.rewritten.discard(self.fam)
            self.close()
            log.warning("fxcoalesce: every rank runs %s uncompiled from here (%s), so each "
                        "issues the program's own collectives there, and runs its rewritten "
                        "graphs, where Dynamo still calls them, in that order",
                        self.fam.split("@")[0], self.reason[:100])
            return
        self.close()
        rank, name = dist.get_rank(), self.fam.split("@")[0]
        raise CollectiveMismatchError(
            f"fxcoalesce: rank {rank} runs {name} uncompiled here (Dynamo: {self.reason[:100]}) "
            f"where the ranks agreed to run it rewritten, and a peer runs the rewritten graph "
            f"here (group {group}): their collectives cannot pair, and none was returned. "
            f"{FIX}")


class _Done:
    """The finished work of a watched ``async_op=True`` all_reduce (done synchronously)."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


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
        kwargs = kwargs or {}
        c10d = torch.ops._c10d_functional
        if getattr(func, "namespace", "") != "_c10d_functional" or func is c10d.wait_tensor.default:
            return func(*args, **kwargs)
        x, group = args[0], args[-1]
        if not _opens(self.firsts, group, func is c10d.all_reduce.default, str(args[1]), x):
            return func(*args, **kwargs)
        n = x.numel()
        out = c10d.wait_tensor.default(func(_tagged(x, self.tag), args[1], group))
        if not agrees(out[n:], self.tag):
            raise CollectiveMismatchError(f"{message(self.name, self.tag)}. {FIX}")
        return out[:n].view(x.shape).clone()


def _opens(firsts: Firsts, group: str, is_all_reduce: bool, op: str, x) -> bool:
    """Record one collective run eagerly; True where it is its group's checked first
    all_reduce (the one a tag rides on)."""
    world = dist.distributed_c10d._resolve_process_group(group).size()
    return firsts.opens(group, is_all_reduce,
                        is_all_reduce and taggable_value(op, x.dtype, world), x)


def _tagged(x, tag: int):
    """``x`` flattened, the tag's elements after it (``tag.bits``)."""
    return torch.cat([x.reshape(-1), torch.tensor(bits(tag), dtype=x.dtype, device=x.device)])


def _runs_original(new, orig) -> bool:
    """Does ``new``, the code Dynamo made for ``orig``, end by running the rest of ``orig``'s
    own bytecode (a compile up to a graph break Dynamo cannot resume from)? Read from the
    instructions the two end with alike (jump targets aside): at least 8, a call among them."""
    import dis

    def ops(code):
        return [(i.opname, None if i.opcode in dis.hasjrel or i.opcode in dis.hasjabs
                 else repr(i.argval)) for i in dis.get_instructions(code)]

    want, have = ops(orig), ops(new)
    n = 0
    while n < min(len(want), len(have)) and want[-1 - n] == have[-1 - n]:
        n += 1
    return n >= 8 and any(op.startswith("CALL") for op, _ in want[len(want) - n:])

