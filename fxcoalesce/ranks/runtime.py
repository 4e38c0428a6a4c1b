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
  (``ranks.tag``); their check raises on every rank of the pairing. The wrapper turns the
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
from .check import CollectiveMismatchError

log = logging.getLogger("fxcoalesce")
REMEDY = (". Keep graph breaks alike on every rank (a print on one rank: "
          "torch._dynamo.config.reorderable_logging_functions.add(print)), or compile such a "
          "program with Config(passes=('schedule',)); see docs/rank-agreement.md")


LIMIT_HIT = re.compile(r"^torch\._dynamo hit config\.(\w+) \((\d+)\)\s+function: '([^']+)' "
                       r"\((.+):(\d+)\)")
"""Dynamo's warning when it stops compiling a function and runs it uncompiled."""


class _RecompileLimit(logging.Handler):
    """Dynamo's recompile limit, reached on this rank: remembered for the message of the
    skip that follows (:func:`skipped`). Where Dynamo has no skip hook to wrap (an older
    torch), it stops this rank here, before the frame runs."""

    def emit(self, record: logging.LogRecord) -> None:
        m = LIMIT_HIT.match(record.getMessage())
        if m is None or not dist.is_initialized():
            return
        limit, value, name, path, line = m.groups()
        frame = f"{name}@{os.path.basename(path)}:{line}"
        _LIMITS[frame] = (limit, value)
        from ..graph_compile import OPENS

        if not _SKIPS_WATCHED and frame in OPENS:
            _stop(frame, _compiling_scope(frame), "")


def _compiling_scope(key: str) -> dict | None:
    """The locals and globals (``L``, ``G``) of the frame Dynamo is compiling, read off the
    Python stack of its recompile-limit warning (no skip hook to wrap): the frame object
    whose code is ``key``'s, which Dynamo's callers hold."""
    import sys

    caller = sys._getframe(1)
    while caller is not None:
        for v in caller.f_locals.values():
            if hasattr(v, "f_code") and hasattr(v, "f_locals") and _key(v.f_code) == key:
                return {"L": v.f_locals, "G": v.f_globals}
        caller = caller.f_back
    return None


_LIMITS: dict = {}
"""Frame -> (Dynamo's limit, its value) when this rank reached it there."""
_SKIPS_WATCHED: list = []
SKIP_HOOK = "auto"
"""Where to hear what Dynamo made of a frame: ``"auto"``, its ``_handle_skip`` where this
torch has one (2.13 on), else the wrapper's ``__call__`` (2.11); ``"call"``, the latter
always (tests); False, neither (the recompile limit's warning only; tests)."""


def watch_dynamo() -> None:
    """Hook Dynamo's frame skips (:func:`skipped`) and its recompile-limit warning
    (:class:`_RecompileLimit`; again, where torch's logging set-up replaced its handlers)."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(h, _RecompileLimit) for h in logger.handlers):
        logger.addHandler(_RecompileLimit())
    if _SKIPS_WATCHED or not SKIP_HOOK:
        return
    from torch._dynamo import convert_frame

    wrapper = getattr(convert_frame, "CatchErrorsWrapper", None)
    if wrapper is None:  # not this torch's shape: the limit's warning only
        return

    def listen(result, frame, uncompiled: str | None) -> None:
        try:
            _heard(result, frame, uncompiled)
        except CollectiveMismatchError:
            raise
        except Exception:  # never break Dynamo: this rank goes on as without the hook
            log.exception("fxcoalesce: could not look at Dynamo's result for %s",
                          frame.f_code.co_name)

    orig = getattr(wrapper, "_handle_skip", None)
    if orig is not None and SKIP_HOOK == "auto":
        def _handle_skip(self, result, frame):
            listen(result, frame, None)
            return orig(self, result, frame)

        wrapper._handle_skip = _handle_skip
        _SKIPS_WATCHED.append(("_handle_skip", orig))
        return
    # torch 2.11: every result leaves through __call__, a skip as a result without code
    call = wrapper.__call__

    def __call__(self, frame, *args, **kwargs):
        result = call(self, frame, *args, **kwargs)
        listen(result, frame, "no compiled code")
        return result

    wrapper.__call__ = __call__
    _SKIPS_WATCHED.append(("__call__", call))


def _heard(result, frame, uncompiled: str | None = None) -> None:
    """What Dynamo made of ``frame``: a frame of a tagged graph here that it skipped, or
    compiled only in part, goes to :func:`skipped` (``uncompiled``: the reason to give
    where the result has no code and says no reason, else such a result is not a skip)."""
    reason = getattr(result, "skip_reason", None) or uncompiled
    code = getattr(getattr(result, "guarded_code", None), "code", None)
    if not _tagged_here(frame.f_code):
        return
    if code is None and reason is not None:
        skipped(frame, str(reason))
    elif code is not None and _runs_original(code, frame.f_code):
        skipped(frame, _PARTLY)


def _tagged_here(code) -> bool:
    from ..graph_compile import OPENS

    return bool(OPENS) and _key(code) in OPENS


def _key(code) -> str:
    return f"{code.co_name}@{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


def _runs_original(new, orig) -> bool:
    """Does ``new``, the code Dynamo made for ``orig``, end by running the rest of ``orig``'s
    own bytecode (what Dynamo emits where it compiles up to a graph break it cannot resume
    from, then runs the rest of the function uncompiled)? Read from the instructions the
    two end with alike (jump targets aside): at least :data:`_TAIL` of them, a call among
    them. A compiled function ends otherwise: the graph's outputs, or a resume function."""
    import dis

    def ops(code):
        return [(i.opname, None if i.opcode in dis.hasjrel or i.opcode in dis.hasjabs
                 else repr(i.argval)) for i in dis.get_instructions(code)]

    want, have = ops(orig), ops(new)
    n = 0
    while n < min(len(want), len(have)) and want[-1 - n] == have[-1 - n]:
        n += 1
    return n >= _TAIL and any(op.startswith("CALL") for op, _ in want[len(want) - n:])


_TAIL = 8
_RETIRED_WHY: dict[str, str] = {}
"""Why a function (``exchange.family``) was retired, where not for its cuts."""
_PARTLY = "partly"
"""The reason :func:`skipped` hears where Dynamo runs the rest of a frame uncompiled."""


def skipped(frame, reason: str) -> None:
    """Dynamo runs ``frame`` uncompiled from here on this rank (it skipped the frame at a
    recompile, gave up recompiling it, or compiled it only up to a graph break it cannot
    resume from: ``reason`` :data:`_PARTLY`), where this rank ran a tagged graph of it: its
    peers may run that graph while this rank issues the program's own collectives,
    untagged (a transport abort or wrong values). The ranks that run it uncompiled vote in
    the store (:meth:`~fxcoalesce.ranks.exchange.Exchange.skip_vote`): where every rank does, all
    run the program's own collectives (right, as under plain); else this rank stops loudly
    before the frame runs, and sends its peers what makes their checks fail at once."""
    if dist.is_initialized():
        _stop(_key(frame.f_code), {"L": frame.f_locals, "G": frame.f_globals}, reason)


def _stop(key: str, scope: dict | None, reason: str) -> None:
    """Stop this rank before it runs ``key`` uncompiled where a peer may run its tagged
    graph (``scope``: the frame's locals and globals as ``L`` and ``G``; None: not known,
    no vote)."""
    from .exchange import group_timeout_s, process_env
    from ..graph_compile import OPENS

    if family(key) in RETIRED:
        # every rank already runs the function's graphs in the program's own order (a
        # unanimous vote before, or its cut varied): running it uncompiled here pairs
        # with them, as under plain (fuzz seed 140124: rank 0 alone re-cut it after the
        # vote, stopped, and its stand-ins for the retired rewrite had gloo abort rank 1)
        return
    try:
        env = process_env()
    except Exception:  # no store to read: nothing agreed here
        return
    name, rank = key.split("@")[0], dist.get_rank()
    entries, inputs, prelude = _running(OPENS.get(key, []), scope or {})
    limit = _LIMITS.pop(key, None)
    others, send = "its peers run it rewritten", True
    groups = {g for guarded in OPENS.get(key, []) for g in guarded.groups}
    # a peer that runs it compiled may be blocked in a collective of a group that is not
    # checked (an all_gather first there: fuzz seed 90026, a 20 s vote): watch all; and the
    # peers are every group's (where no check is first in its group, ``groups`` is empty,
    # and a vote of no peers came back unanimous: fuzz seed 130162, gloo aborted)
    watched = groups | {g for guarded in OPENS.get(key, []) for g in guarded.issues_on}
    peers = _members(watched)
    if scope is not None:
        wait = min(60.0, 0.5 * (group_timeout_s(default_group()) or 120.0))
        vote = env.exchange.skip_vote(key, peers - {rank}, watched, wait)
        if vote is None:
            # Dynamo still runs a compiled graph of it wherever its guards match again (a
            # peer's may while this rank's never do): every rank retires them here
            RETIRED.add(family(key))
            env.rewritten.discard(family(key))  # its later graphs carry no tags
            _RETIRED_WHY[family(key)] = "Dynamo runs it uncompiled on every rank"
            log.warning("fxcoalesce: every rank runs %s uncompiled from here (%s), so each "
                        "issues the program's own collectives there, and runs its rewritten "
                        "graphs, where Dynamo still calls them, in that order", name,
                        f"Dynamo's {limit[0]}" if limit else
                        "a graph break Dynamo cannot resume from" if reason == _PARTLY else
                        reason[:100])
            return
        others, send = vote
    if limit:
        what = f"reached Dynamo's {limit[0]} ({limit[1]}) for {name}"
        fix = (f"Make the value that recompiles {name} the same on every rank, raise "
               f"torch._dynamo.config.{limit[0]}, or compile it with "
               "Config(passes=('schedule',))")
    else:
        what = (f"had Dynamo compile {name} again only up to a graph break it cannot resume "
                "from, the rest to run uncompiled" if reason == _PARTLY else
                f"had Dynamo skip {name} at a recompile ({reason[:100]})")
        fix = (f"Keep {name}'s graph breaks alike on every rank and out of loops (a print on "
               "one rank: torch._dynamo.config.reorderable_logging_functions.add(print)), or "
               "compile it with Config(passes=('schedule',)); see docs/rank-agreement.md")
    why = (f"rank {rank} {what}, which the ranks agreed to run rewritten, and would run it "
           f"uncompiled (its collectives then differ from its peers': {others})")
    try:
        env.exchange.stop(f"{why}. {fix}")
        if send:
            _stop_peers(entries, inputs, prelude=prelude)
        env.exchange.heard(peers - {rank}, 5.0)
    except Exception:  # the store or the group went with a peer that stopped first
        pass
    raise CollectiveMismatchError(f"fxcoalesce: {why}. {fix}")


def _running(tagged: list, scope: dict) -> tuple[list, dict, list | None]:
    """Of a frame's tagged graphs (``graph_compile.OPENS``), the latest whose inputs'
    shapes fit what the frame reads now (``scope``: its ``L`` and ``G``) (what its peers
    run, unless another guard of theirs differs): its checks (``graph_compile.checks_of``),
    its size symbols' values and what to send before the checks
    (``graph_compile.stand_ins_of``); ([], {}, []) where none fits or the inputs cannot be
    read."""
    import torch

    from ..graph_compile import checks_of, stand_ins_of

    for guarded in reversed(tagged):
        try:
            args = [_source_value(ph._dynamo_source, scope)
                    for ph in guarded.gm.graph.nodes if ph.op == "placeholder"]
        except Exception:  # a source outside the frame's locals
            continue
        phs = [n for n in guarded.gm.graph.nodes if n.op == "placeholder"]
        fits = all(not isinstance(ex := n.meta.get("example_value"), torch.Tensor) or (
            isinstance(a, torch.Tensor) and len(a.shape) == len(ex.shape) and all(
                isinstance(d, torch.SymInt) or d == v for d, v in zip(ex.shape, a.shape)))
            for n, a in zip(phs, args))
        if fits:
            world = frozenset(range(dist.get_world_size()))
            return (checks_of(guarded.checked), graph_symbols(guarded.gm, args),
                    stand_ins_of(guarded.checked, world))
    return [], {}, []


def _members(groups: set) -> set[int]:
    """The ranks of the groups named (the world where one is not known here)."""
    from .tag import group_members

    out: set[int] = set()
    for g in groups:
        ranks = group_members(g)
        if ranks is None:
            return set(range(dist.get_world_size()))
        out |= ranks
    return out


_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


def _stop_peers(entries: list, inputs: dict, after: int = -1,
                prelude: list | None = ()) -> None:
    """Send, in each group of ``entries`` (``graph_compile.checks_of`` the graph the peers
    run) past check ``after``, what its check there receives, with a tag no rank can send
    (every bit and its complement set; cleared under min): the peers there pair it with
    that all_reduce and fail its check at once, instead of waiting for this rank until the
    group's timeout. ``prelude`` (``graph_compile.stand_ins_of``) goes first, zeros: the
    collectives the peers issue before the first check; None: they sit in collectives no
    stand-in can answer, and nothing is sent. ``inputs``: the values of the graph's size
    symbols (:func:`_concrete`)."""
    import torch

    from .tag import TAG_BITS

    if prelude is None or not _send_zeros(prelude, inputs):
        return
    for group, op, dtype, numel, device in entries[after + 1:]:
        numel = _concrete(numel, inputs)
        if numel is None:  # cannot be sized here: the peers there wait for the group
            return
        poison = torch.zeros(numel, dtype=dtype, device=device)
        poison[-2 * TAG_BITS:] = 0 if op == "min" else 1  # each pair: 1 and 1 (0 and 0)
        try:
            dist.all_reduce(poison, _OPS[op],
                            group=dist.distributed_c10d._resolve_process_group(group))
        except Exception:  # the peers stopped first, or the group is gone: they know
            return


def _send_zeros(prelude: list, inputs: dict) -> bool:
    """Zeros in each collective of ``prelude`` (kind, group, op, dtype, elements, device),
    in order; False where one could not be sized or sent (nothing more is: the peers there
    wait for the group, as they would without it)."""
    import torch

    for kind, group, op, dtype, numel, device in prelude:
        numel = _concrete(numel, inputs)
        if numel is None:
            return False
        pg = dist.distributed_c10d._resolve_process_group(group)
        size = dist.get_world_size(pg)
        zeros = torch.zeros(numel, dtype=dtype, device=device)
        try:
            if kind == "all_gather":
                dist.all_gather_into_tensor(zeros.new_zeros(numel * size), zeros, group=pg)
            elif kind == "reduce_scatter":
                dist.reduce_scatter_tensor(zeros.new_zeros(numel // size), zeros, _OPS[op],
                                           group=pg)
            else:
                dist.all_reduce(zeros, _OPS[op], group=pg)
        except Exception:  # the peers stopped first, or the group is gone: they know
            return False
    return True


def _concrete(numel, symbols: dict) -> int | None:
    """``numel`` as an int: itself, or a SymInt evaluated on its symbols' values
    (:func:`graph_symbols`); None where one is missing (an unbacked size)."""
    if isinstance(numel, int):
        return numel
    try:
        import sympy

        expr = numel.node.expr
        return int(expr.xreplace({s: sympy.Integer(symbols[s]) for s in expr.free_symbols}))
    except Exception:  # a symbol not among the inputs' sizes
        return None


def _source_value(source, scope: dict):
    """What a Dynamo source (``L['x']``, ``G['W'][0]``) reads in ``scope`` (``L``, ``G``)."""
    if hasattr(source, "get_value"):
        return source.get_value(scope, {}, {})
    name = source.name() if callable(source.name) else source.name
    return eval(name, dict(scope))


def graph_symbols(gm, args) -> dict:
    """The size symbols of a Dynamo graph ``gm`` that its inputs ``args`` show directly (a
    dimension, or an int input, that is one symbol), with their values."""
    import torch

    out = {}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, arg in zip(phs, args):
        example = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(example, torch.SymInt):
            pairs = [(example, arg)]
        elif isinstance(example, torch.Tensor) and isinstance(arg, torch.Tensor):
            pairs = list(zip(example.shape, arg.shape))
        else:
            continue
        for size, value in pairs:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                out[size.node.expr] = int(value)
    return out


def stopped_peers() -> str | None:
    """Why a peer stopped on purpose (:func:`_stop`), if one did: read from the
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
        tagged = [g for g in graphs if g.tagged]
        self.checked = tagged[0].graph if len(tagged) == 1 else None
        """The tagged ATen graph (one): what a rank that stops sends peers (:func:`_stop`)."""
        if self.checked is not None and job.frame:
            from ..graph_compile import OPENS, checks_of

            self.groups = {e[0] for e in checks_of(self.checked)}
            from ..collectives import group_of, is_collective

            self.issues_on = {group_of(n) for n in self.checked.graph.nodes
                              if is_collective(n)} - {None}
            """Every group it issues a collective on, checked or not: where a peer that
            runs it shows its position (:func:`_stop`'s vote)."""
            OPENS.setdefault(job.frame, []).append(self)
            del OPENS[job.frame][:-8]
        self.retired = False
        """Retired (:meth:`_retire`): it runs the program's own order for good."""
        self.retirable = bool(self.family and graphs) and any(
            g.tagged or (g.sequences and g.step != len(ladder(self.cfg)) - 1) for g in graphs)
        watch_dynamo()

    def __call__(self, *args, **kwargs):
        if default_group() is not self.group:
            self._again()
        if self.retirable and self.family in RETIRED:
            self._retire()
        try:
            return self.run(*args, **kwargs)
        except RuntimeError as e:
            from .tag import MESSAGE_START

            if MESSAGE_START in str(e) and REMEDY not in str(e):
                self._stop_later_checks(str(e), args)
                why = stopped_peers()  # a peer that stopped on purpose says why
                raise CollectiveMismatchError(
                    str(e) + (f"; {why}" if why else "") + REMEDY) from None
            if not isinstance(e, CollectiveMismatchError) and (why := stopped_peers()):
                raise CollectiveMismatchError(f"fxcoalesce: {why}; this rank's collective "
                                              f"could not complete ({e})") from None
            raise

    def _stop_later_checks(self, error: str, args) -> None:
        """This rank failed a check of its graph: send what each later check receives, so
        that the peers it meets only in later groups stop there too, not on the group's
        timeout."""
        from .tag import failed_check

        from ..graph_compile import checks_of

        failed = failed_check(error)
        if failed is not None and self.checked is not None:
            _stop_peers(checks_of(self.checked), graph_symbols(self.gm, args), failed)

    def _retire(self) -> None:
        """The ranks retired this graph's function's rewritten graphs together: they saw it
        cut in two ways (``exchange``, "cut varies"), or every rank's Dynamo runs it
        uncompiled from a call on (:func:`_stop`). Run the program's own order, untagged,
        as the function's later graphs, or its uncompiled runs, do on every rank."""
        log.warning("fxcoalesce[%s]: %s, so every rank runs its rewritten graphs in the "
                    "program's own order from now on (eagerly)", self.name,
                    _RETIRED_WHY.get(self.family, "its function is cut into graphs in more "
                                                  "than one way"))
        self.retirable, self.retired = False, True
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
        if self.retired or (self.retirable and self.family in RETIRED):
            return  # the program's own order on every rank (retired together): no agreement
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
    of the program's order that no rank rewrote, ``ranks.tag``)."""

    def __init__(self, gm, name: str, tag: int = 0):
        self.gm, self.name, self.tag = gm, name, tag

    def __call__(self, *args, **kwargs):
        if not self.tag:
            return self.gm(*args, **kwargs)
        with _FirstTags(self.name, self.tag):
            return self.gm(*args, **kwargs)


class _FirstTags(TorchDispatchMode):
    """Tag the first all_reduce of each group as ``ranks.tag`` does, check it before
    anything more is issued."""

    def __init__(self, name: str, tag: int):
        super().__init__()
        self.name, self.tag, self.seen = name, tag, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        from .tag import agrees, bits, message, taggable_value

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
