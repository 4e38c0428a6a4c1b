"""The ranks' agreement on one graph, through the default group's c10d store (``agreement``
explains the protocol and why it pairs every collective; this module runs it).

    outcome = agree_graph("graph 3", cfg, steps, program, sequences, workspaces,
                          check_ranks=False)
    outcome.step          # the ladder step this rank compiles
    outcome.agreement     # what the report says (how, waited_s, differences)

Keys, under ``fxcoalesce/agree/v1/<restart>/`` of the default store: ``<D>/p/<rank>`` (a
rank's first proposal for program key D: never overwritten), ``<D>/d`` (the register: a JSON
list of decision entries, extended by compare-and-set), ``log/<rank>`` (every graph a rank
proposed, where it starts in each group's stream and, once decided, how many collectives it
issues there: what peers read as evidence of another cut). Store calls only: no collective
on any process group, so nothing here can pair with a peer's data collective.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .agreement import (TIMEOUT_ENV, Agreement, Step, canonical, decide, program_step,
                        timeout_s)
from ..config import Config
from .check import Sequence, _resolve

log = logging.getLogger("fxcoalesce")
NAMESPACE = "fxcoalesce/agree/v1"
POLL_S = (0.002, 0.05)
"""First and longest pause between two looks at the store."""
FRESH = ("agreed", "fell back")
"""Entries made from every rank's proposal, read while every rank waits for them."""


class Exchange:
    """This process's view of the agreement keys in one store."""

    def __init__(self, store, rank: int, namespace: str):
        self.store, self.rank, self.ns = store, rank, namespace
        self.joined = False

    def new_id(self) -> int:
        """A tag id no other decision in this store has (``ranks.tag``): a counter in the
        store. A process that used ids in an earlier store first moves the counter past
        them (a group made anew keeps Dynamo's compiled graphs, and their ids)."""
        from .tag import TAG_BITS

        key = self._key("ids")
        if not self.joined:
            self.store.add(key, _MAX_ID[0])
            self.joined = True
        i = self.store.add(key, 1)
        return (i - 1) % (2 ** TAG_BITS - 1) + 1

    def stop(self, why: str) -> None:
        """Say that this rank stops on purpose, and why (``runtime``; any
        ``CollectiveMismatchError``, :func:`say_stopped`); ``stopped/any`` tells every
        peer's heartbeat to look (:func:`_heard_a_stop`)."""
        _SAID.append(why)  # first: this rank's heartbeat then sends it no error of its own
        self.store.set(self._key("stopped", self.rank), why)
        self.store.set(self._key("stopped", "any"), str(self.rank))

    def stopped(self, peers_only: bool = False) -> str | None:
        """Why a rank of this store stopped on purpose, if one did (the first found); with
        ``peers_only``, a rank other than this one."""
        ranks = range(dist.get_world_size() if dist.is_initialized() else 0)
        ranks = [r for r in ranks if not (peers_only and r == self.rank)]
        return next(filter(None, map(self.stopped_rank, ranks)), None)

    def positions(self, rank: int) -> dict:
        """``rank``'s last published stream positions (:func:`heartbeat`), by group name."""
        return self._get(self._key("at", rank)) or {}

    def skip_vote(self, frame: str, peers: set[int], groups: set, wait_s: float
                  ) -> tuple[str, bool] | None:
        """This rank runs ``frame`` uncompiled from here (``runtime.skipped``), where it ran
        a tagged graph: say so, then look at ``peers``. None when every one of them says so
        too (each issues the program's own collectives there, as under plain); else why
        not, and whether the peers run a graph compiled before (what this rank can send
        them, ``runtime._stop_peers``): a peer issued a collective of ``groups`` past this
        rank's position (it runs a compiled graph there: its heartbeat says so within a
        second), waits for proposals there (it compiles the function anew: :meth:`waits`),
        stopped, or did not say within ``wait_s`` seconds. Each rank's n-th skip of
        ``frame`` votes with the others' n-th."""
        mine = {g: at for g, at in _all_positions().items() if g in groups}
        n = self.store.add(self._key("skip", frame, "n", self.rank), 1)
        said = self._key("skip", frame, n)
        self.store.set(f"{said}/{self.rank}", "1")
        deadline, pending = time.monotonic() + wait_s, set(peers)
        while pending:
            for q in sorted(pending):
                if self.store.check([f"{said}/{q}"]):
                    pending.discard(q)
                elif self.store.check([self._key("stopped", q)]):
                    return f"rank {q} stopped", True
                elif any(self.positions(q).get(g, -1) > at for g, at in mine.items()) and (
                        not self.store.check([f"{said}/{q}"])):  # (it says so first)
                    return f"rank {q} runs it compiled", True
                elif (w := self._get(self._key("waits", q))) and all(
                        w.get(g) == at for g, at in mine.items()):
                    return f"rank {q} compiles it anew", False
            if pending and time.monotonic() > deadline:
                return f"rank(s) {sorted(pending)} did not say within {wait_s:.0f} s", True
            time.sleep(POLL_S[1])
        return None

    def waits(self, positions: dict | None) -> None:
        """Say that this rank waits for its peers' proposals for a graph that starts at
        ``positions`` (None: no longer)."""
        self.store.set(self._key("waits", self.rank), json.dumps(positions or {}))

    def stopped_rank(self, rank: int) -> str | None:
        """Why ``rank`` stopped on purpose (:meth:`stop`), if it did (then this rank says it
        read that: :meth:`heard`)."""
        key = self._key("stopped", rank)
        if not self.store.check([key]):
            return None
        self.store.set(self._key("heard", self.rank), "1")
        return self.store.get(key).decode()

    def heard(self, peers: set[int], wait_s: float) -> None:
        """Wait (at most ``wait_s``) until ``peers`` have read why this rank stopped: the
        store may live in this process, and go with it."""
        try:
            _await_every(lambda kind, q: self.store.check([self._key(kind, q)]), peers,
                         ("heard",), wait_s)
        except Exception:  # the store went with the peer that hosted it: it has read
            return

    def _key(self, *parts) -> str:
        return "/".join([self.ns, *map(str, parts)])

    def _get(self, key: str):
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def proposal(self, d: str, rank: int) -> dict | None:
        return self._get(self._key(d, "p", rank))

    def propose(self, d: str, proposal: dict) -> dict:
        """Publish this rank's first proposal for ``d``; returns the one there if any."""
        got = self.store.compare_set(self._key(d, "p", self.rank), "", json.dumps(proposal))
        return json.loads(got.decode())

    def entries(self, d: str) -> list[dict]:
        return self._get(self._key(d, "d")) or []

    def add(self, d: str, entry: dict) -> list[dict]:
        """Append ``entry`` to the register unless an entry already names one of its ranks
        (then the register as it is). Compare-and-set, retried: never loses an entry."""
        key = self._key(d, "d")
        while True:
            raw = self.store.get(key).decode() if self.store.check([key]) else ""
            current = json.loads(raw) if raw else []
            if any(set(e["ranks"]) & set(entry["ranks"]) for e in current):
                return current
            new = json.dumps(current + [entry])
            if self.store.compare_set(key, raw, new).decode() == new:
                return current + [entry]

    def gone(self, rank: int) -> str | None:
        """Why ``rank``'s process has ended, or None when it may still run: it left
        ``gone/<rank>`` at exit (:func:`mark_exit`), or it said where it runs
        (:func:`announce`) and no such process is alive on this host any more."""
        key = self._key("gone", rank)
        if self.store.check([key]):
            return self.store.get(key).decode()
        where = self._get(self._key("pid", rank))
        if where and where["host"] == socket.gethostname() and not _alive(where["pid"]):
            return f"its process {where['pid']} is gone"
        return None

    def note(self, line: dict) -> None:
        self.store.append(self._key("log", self.rank), json.dumps(line) + "\n")

    def notes(self, rank: int) -> list[dict]:
        key = self._key("log", rank)
        if not self.store.check([key]):
            return []
        return [json.loads(x) for x in self.store.get(key).decode().splitlines() if x]


@dataclass(slots=True)
class RankEnv:
    """What the agreement reads of this rank's process: its exchange, what it knows of each
    program key, and its groups' members and stream positions. ``process_env()`` is the
    real one; a test can make one per simulated rank over one in-memory store."""

    exchange: Exchange
    members: Callable[[str], list[int]]
    position: Callable[[str], int | None]
    timeout: Callable[[str], float | None] = lambda g: None
    """The group's own collective timeout (s): no rank waits for its peers longer."""
    local: dict = field(default_factory=dict)
    """Program key -> :class:`_Local`."""
    alone: set = field(default_factory=set)
    """Functions (:func:`family`) whose graphs a rank recompiles alone: the ranks decided
    "guards differ" on one of them. A later graph of one is not waited for."""
    rewritten: set = field(default_factory=set)
    """Functions (:func:`family`) this rank runs a rewritten graph of: a later graph of one
    carries tags (``ranks.tag``)."""
    retired: set = field(default_factory=set)
    """Functions whose rewritten and tagged graphs this rank runs in the program's own order
    from now on (``runtime.Guarded``): every rank of a decision "cut varies" retires them
    together, before any runs the new graph."""
    cuts: dict = field(default_factory=dict)
    """Frame (:func:`frame_identity`) -> the cuts (:func:`cut_at`) this rank compiled it
    with: a function cut in two ways is not rewritten (:func:`varied`)."""


_ENVS: dict[int, RankEnv] = {}


def process_env() -> RankEnv:
    """The env of this process's default process group (its store, its groups)."""
    store = dist.distributed_c10d._get_default_store()
    if id(store) not in _ENVS:
        announce()
        _ENVS.clear()  # a new default group: the old keys belong to another job
        ex = Exchange(store, dist.get_rank(), _namespace())
        _ENVS[id(store)] = RankEnv(
            ex, members=lambda g: dist.get_process_group_ranks(_resolve(g)),
            position=lambda g: _position(_resolve(g)),
            timeout=lambda g: group_timeout_s(_resolve(g)),
            retired=RETIRED, cuts=CUTS)
        heartbeat()
    return _ENVS[id(store)]


RETIRED: set = set()
CUTS: dict = {}
"""This process's :attr:`RankEnv.retired` and :attr:`RankEnv.cuts` (Dynamo's compiled
graphs outlive a process group; :attr:`RankEnv.rewritten` does not: a graph compiled in an
earlier group runs in this one only where the ranks agreed on it again, ``runtime``)."""
_MAX_ID = [0]
"""The largest tag id this process has taken."""


def seen(cuts: dict, frame: str, cut: str | None) -> None:
    """Record that ``frame`` was compiled cut at ``cut`` (every graph through the backend)."""
    if frame:
        cuts.setdefault(frame, set()).add(cut)


def varied(cuts: dict, frame: str) -> str | None:
    """A frame of ``frame``'s function that this rank compiled cut in two ways (a print that
    only some steps reach, a flag that changes), or None. Such a function can be re-cut
    again later by a rank alone, and a graph cut the earlier way is cached untagged."""
    fam = family(frame) if frame else None
    for f, how in cuts.items():
        if fam is not None and family(f) == fam and len(how) > 1:
            return f.split("@")[0]
    return None


HEARTBEAT_S = 0.5
_BEAT: list = []
"""The heartbeat thread, once started (one per process)."""


def heartbeat() -> None:
    """Publish, every :data:`HEARTBEAT_S` from one daemon thread, how many collectives this
    rank has issued on each of its groups (``at/<rank>`` in the default group's store). A
    peer waiting for this rank's proposal reads it: a count past where its graph starts
    means this rank runs that stretch without compiling it (Dynamo skipped the frame, eager
    code), so the peer stops waiting at once. The thread follows the default group: after a
    group is made anew it writes into the new store, even where this rank runs nothing of
    fxcoalesce's there (a frame run uncompiled). It runs while this rank is blocked inside a
    collective (c10d waits release the GIL)."""
    import threading

    if _BEAT:
        return

    def beat():
        last: dict[int, str] = {}
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                if not dist.is_initialized() or dist.get_backend() == "fake" or (
                        dist.get_world_size() < 2):
                    continue
                store = dist.distributed_c10d._get_default_store()
                now = json.dumps(_all_positions(), sort_keys=True)
                if last.get(id(store)) != now:
                    store.set(f"{_namespace()}/at/{dist.get_rank()}", now)
                    last = {id(store): now}
                    _KEPT[id(store)] = store
                _heard_a_stop(store)
            except Exception:  # a group torn down or made meanwhile: look again later
                continue

    _BEAT.append(threading.Thread(target=beat, daemon=True, name="fxcoalesce-heartbeat"))
    _BEAT[0].start()


_INTERRUPTED: list = []
"""Why this rank's main thread was sent a :class:`CollectiveMismatchError` (once)."""
_EXITING = [False]


def _heard_a_stop(store) -> None:
    """A peer stopped on purpose (:meth:`Exchange.stop`) and this rank has not raised: send
    its main thread the peer's error, raised at its next Python instruction. The rank may be
    where no fxcoalesce code runs: in an eager collective with the stopped rank (which then
    fails with the transport's error once that rank's process ends: the peer waits at exit
    until every rank has read why, :func:`mark_exit`), or in code that would reach one; or
    in a tagged collective, before the stopped rank's stand-ins fail its check (a race:
    either error says why)."""
    import threading

    from .check import RAISED

    if _INTERRUPTED or RAISED[0] or _SAID or _EXITING[0] or not store.check(
            [f"{_namespace()}/stopped/any"]):
        return
    # a peer's reason, never this rank's own: a rank that stops writes its reason, then
    # raises; read between the two, its own would land as a second error after the first
    # was handled (seen: test_rank_safety's looped_partly-call case under load)
    why = Exchange(store, dist.get_rank(), _namespace()).stopped(peers_only=True)
    main = threading.main_thread()
    if not why or RAISED[0] or _SAID or not main.is_alive() or (
            threading.current_thread() is main):
        return
    _INTERRUPTED.append(why)
    _send(main.ident, f"fxcoalesce: {why} (read from the store: this rank was waiting in a "
                      "collective, or ran code outside fxcoalesce's graphs, when that rank "
                      "stopped)")


def _send(thread_id: int, message: str) -> None:
    import ctypes

    from .check import CollectiveMismatchError

    def init(self, *args):
        CollectiveMismatchError.__init__(self, message)

    cls = type("CollectiveMismatchError", (CollectiveMismatchError,),
               {"__init__": init, "__module__": CollectiveMismatchError.__module__})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(cls))


_SAID: list = []
"""What this process said when it stopped (:meth:`Exchange.stop`)."""


def say_stopped(message: str) -> None:
    """This rank raises a ``CollectiveMismatchError``: say so in the store, unless it did
    already (a rank that fails a check at run time, or stops at compile time, may be the
    only one of its pairing that knows; ranks in other groups hear it from the store)."""
    if _SAID or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "fake" or dist.get_world_size() < 2:
            return
        process_env().exchange.stop(message.removeprefix("fxcoalesce: "))
    except Exception:  # the store went with a peer: its own transport error says enough
        return


def cancel_interrupt() -> None:
    """The main thread raises a :class:`CollectiveMismatchError` of its own: drop one sent
    by :func:`_heard_a_stop` and not yet raised."""
    import ctypes
    import threading

    if _INTERRUPTED and threading.current_thread() is threading.main_thread():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(threading.main_thread().ident), None)


_KEPT: dict[int, object] = {}
"""Stores written into, kept alive here: a store freed could leave its id to the next."""


def _all_positions() -> dict:
    out = {}
    for group in list(dist.distributed_c10d._world.pg_names):
        at = _position(group)
        if at is not None:
            out[group.group_name] = at
    return out


def group_timeout_s(group) -> float | None:
    """A process group's own timeout for a collective, in seconds (None if unknown)."""
    for device in getattr(group, "_device_types", None) or [torch.device("cpu")]:
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except Exception:  # a backend without options (fake, custom): nothing to bound by
            continue
    return None


def _namespace() -> str:
    return f"{NAMESPACE}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _alive(pid: int) -> bool:
    """Is process ``pid`` running on this host (a zombie, dead but not yet reaped, is not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: as far as can be told, alive
        return True


_ANNOUNCED: dict[int, object] = {}


def announce() -> None:
    """Say in the default group's store where this rank runs (``pid/<rank>``: host and
    process id), once per store, so a peer on this host that waits for it can tell at
    once when its process has died (a SIGKILL leaves no ``gone`` note); and start its
    :func:`heartbeat` (when fxcoalesce is first used in the process, a backend made)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "fake" or dist.get_world_size() < 2:
            return
        store = dist.distributed_c10d._get_default_store()
        if id(store) in _ANNOUNCED:
            return
        _ANNOUNCED[id(store)] = store  # kept: a freed store's id can come back
        store.set(f"{_namespace()}/pid/{dist.get_rank()}",
                  json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        heartbeat()
    except Exception:  # a group being torn down: peers fall back to the timeouts
        return


LAST_OUT_S = 10.0
"""How long a rank waits at exit, once a rank stopped on purpose, for every peer to have
read why or to have ended (:func:`mark_exit`)."""


def _await_every(has, peers: set[int], kinds: tuple[str, ...], wait_s: float) -> None:
    """Wait (at most ``wait_s``) until each of ``peers`` has left a key of one of ``kinds``
    (``has(kind, rank)``) in the store."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(
            any(has(kind, q) for kind in kinds) for q in peers):
        time.sleep(POLL_S[1])


def mark_exit() -> None:
    """At interpreter exit, leave ``gone/<rank>`` in the default group's store: a peer
    waiting for this rank's proposal stops at once (this rank will compile nothing more).
    Where a rank stopped on purpose (``runtime``), every rank leaves only once every peer
    has read why (or ended): a peer in a collective with this rank fails when this process
    ends, and must have its error from the store first (its heartbeat reads it,
    :func:`_heard_a_stop`); the store itself may live in this process (rank 0 under
    env://). Bounded: a store that does not answer within 2 s is left alone, and the wait
    ends after :data:`LAST_OUT_S`."""
    import threading

    _EXITING[0] = True
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "fake" or dist.get_world_size() < 2:
            return
        store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
        world = dist.get_world_size()
    except Exception:  # a group half torn down: nothing to say
        return
    ns = _namespace()

    def has(kind: str, r) -> bool:
        return store.check([f"{ns}/{kind}/{r}"])

    def say():
        try:
            store.set(f"{ns}/gone/{rank}", "its process ended")
            if not has("stopped", "any"):
                return
            _await_every(has, set(range(world)) - {rank}, ("heard", "gone", "stopped"),
                         LAST_OUT_S)
        except Exception:  # the store's host is gone too
            pass

    t = threading.Thread(target=say, daemon=True)
    t.start()
    t.join(2.0 + LAST_OUT_S)


atexit.register(mark_exit)
announce()  # imported (torch.compile(backend="fxcoalesce") looks the backend up) after init


@dataclass(slots=True)
class Outcome:
    step: int
    agreement: Agreement
    key: str = ""
    """The graph's program key."""
    fresh: bool = False
    """Every rank of the decision took part in it just now (all are at this graph's compile:
    collective set-up such as symmetric memory may run, in the same order on all)."""
    nosymm: int | None = None
    """The step to take instead if preparing symmetric memory fails (on every rank alike)."""
    ws: int = 0
    """The largest symmetric workspace any rank sized for the step (bytes)."""
    error: str | None = None
    """With ``check_ranks``: the difference to raise at the first call."""
    digests: list[str] = field(default_factory=list)
    """Of each step's sequence on this rank, in the rank-invariant form."""
    tag: int = 0
    """The decision's tag id (``ranks.tag``)."""
    tagged: bool = False
    """The graph carries the tag: its step is rewritten, or a rank of the decision runs a
    rewritten graph of its function (a re-cut or recompile of one)."""


@dataclass(slots=True)
class _Local:
    """What this process knows of one program key: which round of agreement it is in, and
    the sequence it issues for the key's graphs (None: not committed, every graph so far
    issued the program's own sequence at every step and went on without waiting)."""

    round: int = 1
    active: str | None = None
    """The digest of the sequence this rank issues for the key's graphs."""
    entry: dict | None = None
    rewritten: bool = False
    """The active sequence is not the program's own."""


def _digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:24]


def _position(group) -> int | None:
    """How many collectives this rank has issued on ``group`` (its c10d sequence number)."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # a backend without one: no position evidence for this group
        return None


def frame_identity() -> str:
    """The Python function Dynamo is compiling (name, file name, first line: the same on
    every rank that runs the same source), "" outside a compile. A graph break's second
    part is a function of its own (``torch_dynamo_resume_in_<fn>_at_<line>``)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    code = ctx.traced_code[0] if ctx is not None and getattr(ctx, "traced_code", None) else None
    if code is None:
        return ""
    return f"{code.co_name}@{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")


def family(frame: str) -> str:
    """The user function a :func:`frame_identity` belongs to ("f@file.py"): a graph break's
    resume function (``torch_dynamo_resume_in_f_at_12``) belongs to ``f``."""
    name, _, rest = frame.partition("@")
    m = _RESUME.match(name)
    return f"{m.group(1) if m else name}@{rest.rsplit(':', 1)[0]}"


def _inside(alone: set) -> str | None:
    """The function of :attr:`RankEnv.alone` (a :func:`family`) that a frame on this
    thread's Python stack runs, if any: a graph Dynamo compiles inside a call of it (a
    function it calls, compiled as a frame of its own after a graph break) is as likely to
    be compiled on this rank alone, so its peers are not waited for."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        fam = family(f"{code.co_name}@{os.path.basename(code.co_filename)}:0")
        if fam in alone:
            return fam
        f = f.f_back
    return None


def cut_at() -> str | None:
    """Where the graph Dynamo is compiling was cut: "file:line: code (why)" of the graph
    break that ended it; None when it ends at a return, or outside a compile."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        reason = InstructionTranslator.current_tx().output.compile_subgraph_reason
    except Exception:  # not inside Dynamo, or another torch's layout: nothing known
        return None
    if reason is None or not getattr(reason, "graph_break", False) or not reason.user_stack:
        return None
    frame = reason.user_stack[-1]
    why = str(reason.reason).strip().splitlines()[0] if reason.reason else "a graph break"
    code = (frame.line or "").strip()
    return f"{os.path.basename(frame.filename)}:{frame.lineno}: {code} ({why})"


VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
"""Guards on a value a later call can change (an int argument, a global flag)."""
_COUNTED = re.compile(r"___\d+")
TORCH_OWN = re.compile(r"\bG\['(torch'|__import_torch(_dot_|'))")
"""Guards on torch's own modules, anywhere in a guard's source
(``dict(type(G['torch'].compiler.config._config[...]).__dict__)['hide']``: torch 2.15
guards on ``compile_on_one_rank`` in a branch one rank takes): process-wide settings, alike on every
rank, not values a later call changes on one rank."""


def guard_keys() -> list[str]:
    """The values the graph Dynamo is compiling is specialized on ("L['step']"): its guards
    on values a later call can change. A value one rank guards on and its peers do not (it
    is read under ``if rank == 0:``) recompiles that rank alone when it changes: ranks
    compare these (``agreement.decide``). [] outside a compile."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    guards = getattr(getattr(ctx, "guards_context", None), "dynamo_guards", None) or ()
    out = set()
    for g in guards:
        try:
            kind = g.create_fn_name()
        except Exception:  # a guard without a builder name: not a value guard
            continue
        if kind in VALUE_GUARDS and g.name and not TORCH_OWN.search(g.name):
            out.add(_COUNTED.sub("___", g.name))
    return sorted(out)


def _config_key(cfg: Config) -> str:
    return repr(replace(cfg, dump_dir=None, dump_passes=False, strict=False))


def agree_graph(name: str, cfg: Config, steps: list[Step], program: Sequence,
                sequences: list[Sequence], workspaces: list[int], *, check_ranks: bool,
                frame: str = "", cut: str | None = None, guards: list[str] | None = None,
                env: RankEnv | None = None) -> Outcome:
    """Agree with the ranks sharing this graph's groups on which of ``steps`` to compile.
    ``sequences[i]`` / ``workspaces[i]``: what step i issues on this rank and the symmetric
    workspace it sizes (bytes, by size hints); ``frame``: :func:`frame_identity` (part of
    the program key: a recompile of one function keeps its key, another function's graph
    with the same collectives does not share it); ``cut``: :func:`cut_at` (told to peers, who
    name it when this rank cut the program differently); ``guards``: :func:`guard_keys`
    (ranks that guard on different values keep the program's order)."""
    env = env or process_env()
    ex = env.exchange
    seen(env.cuts, frame, cut)
    fam = family(frame) if frame else ""
    marked = bool(fam) and fam in env.rewritten
    canon, prog, texts = canonical(program, *sequences)
    groups = [g for g in canon.roles if g is not None]
    members = {g: env.members(g) for g in groups}
    sizes = [f"{canon.role(g)}={len(members[g])}" for g in groups]
    d = hashlib.sha256("\n".join([_config_key(cfg), frame, *sizes, *prog]).encode()
                       ).hexdigest()[:32]
    digests = [_digest(t) for t in texts]
    evident = all(t == prog for t in texts)
    mine = env.local.get(d)
    if mine is not None and mine.active is not None:
        # a later graph of the key (a recompile, a cache hit, or another graph of the same
        # function with the same collectives): it issues what this rank committed to, else
        # the ranks agree again, in a new round
        step = _issuing(digests, mine.active, mine.entry.get("active_step"))
        if step is not None:
            agreement = Agreement(compared=True, step=steps[step].label,
                                  how="decided before", why=_DECIDED,
                                  ranks=list(mine.entry["ranks"]))
            return Outcome(step, agreement, key=d, digests=digests,
                           ws=mine.entry.get("ws", 0), nosymm=mine.entry.get("nosymm"),
                           tag=mine.entry.get("id", 0), tagged=mine.entry.get("tagged", False))
    committed = mine is not None and mine.rewritten
    if mine is None:
        mine = env.local[d] = _Local()
    elif not (mine.active is None and evident and not check_ranks):
        mine.round += 1
    key = d if mine.round == 1 else f"{d}.{mine.round}"
    run = _Run(name, cfg, env, key, steps, program, canon, check_ranks)
    run.cut, run.family = cut, family(frame) if frame else None
    run.inside = _inside(env.alone) if env.alone else None
    run.proposal = ex.propose(key, {
        "groups": [[g, members[g]] for g in groups],
        "pos": {g: env.position(g) for g in groups}, "guards": guards or [],
        "marked": marked, "varied": varied(env.cuts, frame),
        "steps": [{"seq": t, "ws": w} for t, w in zip(texts, workspaces)]})
    ex.note({"d": key, "pos": run.proposal["pos"], "cut": cut,
             "first": {g: _first(program, g) for g in groups}})
    if evident and not check_ranks and not committed and not marked:
        # every step issues the program's sequence here: so does any decision (it agrees
        # with this proposal), whatever and whenever it is made
        out = Outcome(0, Agreement(compared=True, step=steps[-1].label, how="no wait",
                                   ranks=[ex.rank]), key=d, digests=digests)
        run.noted(texts[0])
        return out
    entry, how, waited = run.wait()
    if how == "cut varies" and fam:  # every rank of the closure is here: retire together
        env.retired.add(fam)
        env.rewritten.discard(fam)
    agreement = run.agreement(entry, how, waited)
    out = Outcome(entry["step"], agreement, key=d, fresh=how in FRESH,
                  nosymm=entry.get("nosymm"), ws=entry.get("ws", 0), error=entry.get("error"),
                  digests=digests, tag=entry.get("id", 0), tagged=entry.get("tagged", False))
    _MAX_ID[0] = max(_MAX_ID[0], out.tag)
    if committed and how not in FRESH and out.error is None:
        _changed(out, cfg, name, agreement.step)  # the peers issue the old rewrite
    mine.entry, mine.active = {**entry, "active_step": entry["step"]}, entry["digest"]
    mine.rewritten = entry["digest"] != _digest(prog)
    if out.error is None and digests[out.step] != mine.active:
        step = _issuing(digests, mine.active, None)
        if step is None:
            _changed(out, cfg, name, agreement.step)
        else:
            out.step, out.fresh = step, False
    mine.entry["active_step"] = out.step
    if fam and digests[out.step] != digests[-1]:
        env.rewritten.add(fam)
    run.noted(texts[out.step])
    return out


_DECIDED = ("an earlier graph of this function with the same collectives committed this "
            "rank to that sequence, and a later graph of the key issues it: a rank that "
            "recompiles alone then still pairs with peers that do not")


def _issuing(digests: list[str], active: str, preferred: int | None) -> int | None:
    """The step of this graph that issues the sequence of digest ``active``: ``preferred``
    (the step this rank compiled before) when it does, else the first that does."""
    if preferred is not None and preferred < len(digests) and digests[preferred] == active:
        return preferred
    return next((i for i, dg in enumerate(digests) if dg == active), None)


def without_symm(outcome: Outcome, env: RankEnv | None = None) -> Outcome:
    """``outcome`` moved to its step without symmetric memory (preparing it failed, on
    every rank alike): this process issues that step's sequence for the key from now on."""
    step = outcome.nosymm if outcome.nosymm is not None else len(outcome.digests) - 1
    mine = (env or process_env()).local[outcome.key]
    mine.active, mine.entry["active_step"] = outcome.digests[step], step
    return replace(outcome, step=step, fresh=False)


_CHANGED = ("this rank compiled again a graph that the ranks agreed to run rewritten ({step}), "
            "its passes no longer issue the agreed collectives there, and its peers did not "
            "compile it again (its compute changed on this rank only): the ranks could not "
            "pair them. Compile such a program with Config(passes=('schedule',)) or plain "
            "torch.compile")


def _changed(out: Outcome, cfg: Config, name: str, step: str) -> None:
    """This rank can no longer issue what its peers agreed to run (:data:`_CHANGED`). With
    run-time checks it runs the program's own order, whose tags make the first pairing
    with a peer that still runs the rewrite raise on every rank; without, it raises at
    the graph's first call."""
    if not cfg.run_checks:
        out.error = _CHANGED.format(step=step)
        return
    log.warning("fxcoalesce[%s]: %s; it runs the program's own order, and if its peers still "
                "run the rewrite, the first such collective raises CollectiveMismatchError on "
                "every rank", name, _CHANGED.format(step=step).split(": the ranks")[0])
    out.step, out.fresh = len(out.digests) - 1, False


def _first(program: Sequence, group: str) -> str | None:
    """The first collective ``program`` issues on ``group``, comparable across graphs (its
    description without its place in the graph); None where it has symbolic sizes, whose
    names differ between graphs."""
    desc = next((d for g, d in program if g == group), None)
    if desc is None or _SYMBOLS.search(desc.split("->")[-1]):
        return None
    return desc.split(" <- ")[0]


_SYMBOLS = re.compile(r"\b[suq]\d+\b")


class _Run:
    """One rank's agreement on program key ``d``."""

    def __init__(self, name, cfg, env, d, steps, program, canon, check_ranks):
        self.name, self.cfg, self.d, self.steps = name, cfg, d, steps
        self.env, self.ex = env, env.exchange
        self.program, self.canon, self.check_ranks = program, canon, check_ranks
        self.rank, self.proposal, self.cut, self.family = self.ex.rank, {}, None, None
        self.inside: str | None = None
        self.proposals: dict[int, dict] = {}

    def _entry_of(self, entries: list[dict]) -> dict | None:
        return next((e for e in entries if self.rank in e["ranks"]), None)

    def wait(self) -> tuple[dict, str, float]:
        """(the decision entry naming this rank, how it was reached, seconds waited)."""
        t0, pause = time.monotonic(), POLL_S[0]
        limit, bound = self._limit()
        proposals = self.proposals = {self.rank: self.proposal}
        self.ex.waits(self.proposal["pos"])
        try:
            return self._wait(t0, pause, limit, bound, proposals)
        finally:
            self.ex.waits(None)

    def _wait(self, t0, pause, limit, bound, proposals) -> tuple[dict, str, float]:
        while True:
            entry = self._entry_of(self.ex.entries(self.d))
            if entry is None:
                closure = _closure(proposals)
                for r in sorted(closure - set(proposals)):
                    if (p := self.ex.proposal(self.d, r)) is not None:
                        proposals[r] = p
                closure = _closure(proposals)
                missing = sorted(closure - set(proposals))
                if not missing:
                    entry = self._add(decide({r: proposals[r] for r in closure}, self.steps,
                                             self.check_ranks))
                elif (alone := self.family if self.family in self.env.alone
                       else self.inside) is not None:
                    why = (f"{alone.split('@')[0]} recompiles on some ranks alone (its "
                           "graphs are specialized on a value its peers' are not)")
                    if alone != self.family:
                        why += f"; this graph ({self.family}) is compiled inside a call of it"
                    entry = self._add(self._fallback(closure, "guards differ", why))
                elif stopped := next(filter(None, map(self.ex.stopped_rank, missing)), None):
                    from .check import CollectiveMismatchError

                    raise CollectiveMismatchError(f"fxcoalesce: {stopped}")
                elif gone := [r for r in missing if self.ex.gone(r) is not None]:
                    why = (f"rank(s) {gone} ended before compiling this graph (their "
                           "processes exited)")
                    entry = self._add(self._fallback(closure, "peer gone", why))
                elif (seen_ := self._evidence(closure) or self._uncompiled(missing)):
                    entry = self._add(self._fallback(closure, *seen_))
                elif time.monotonic() - t0 > limit:
                    why = (f"waited {limit:g} s ({bound}) for rank(s) {missing} to compile "
                           "this graph; they did not (they never reach it, cut the program "
                           "into other graphs, or are slow)")
                    entry = self._add(self._fallback(closure, "timed out", why))
            if entry is not None:
                if entry["how"] == "guards differ" and self.family:
                    self.env.alone.add(self.family)
                self._warn(entry)
                return entry, entry["how"], time.monotonic() - t0
            time.sleep(pause)
            pause = min(POLL_S[1], pause * 2)

    def _limit(self) -> tuple[float, str]:
        """(the longest wait, what sets it): ``agree_timeout_s``, or the shortest timeout of
        the graph's groups where that is shorter (plain would fail no later than that)."""
        limit, bound = timeout_s(self.cfg), "agree_timeout_s"
        for g in self.proposal["pos"]:
            t = self.env.timeout(g)
            if t is not None and t < limit:
                limit, bound = t, f"the timeout of group {g}"
        return limit, bound

    def _warn(self, entry: dict) -> None:
        how = entry["how"]
        if how == "program differs":
            log.warning("fxcoalesce[%s]: the program itself issues different collectives on "
                        "different ranks (%s); it runs as written, as plain torch.compile "
                        "would run it", self.name, entry["why"])
        elif how in ("timed out", "cut differently", "peer gone", "guards differ", "cut varies",
                     "runs uncompiled"):
            hazard = (_HAZARD if how == "timed out" and any(v.rewritten for v in
                                                             self.env.local.values()) else "")
            cut = " (the ranks cut the program into graphs differently)" if (
                how == "cut differently") else ""
            log.warning("fxcoalesce[%s]: %s%s: every rank runs this graph in the program's own "
                        "collective order (Config.agree_timeout_s or %s sets the wait)%s",
                        self.name, entry["why"], cut, TIMEOUT_ENV, hazard)
        elif how == "fell back":
            log.warning("fxcoalesce[%s]: ranks would issue different collectives (%s); all "
                        "ranks compile it %s", self.name, "; ".join(entry["differences"]),
                        self.steps[entry["step"]].label)

    def _add(self, entry: dict) -> dict:
        seqs = self.proposal["steps"]
        digest = _digest(seqs[entry["step"]]["seq"])
        marked = any(p.get("marked") for p in self.proposals.values())
        entry = {**entry, "digest": digest, "id": self.ex.new_id(),
                 "tagged": self.cfg.run_checks and entry["how"] != "cut varies" and (
                     marked or digest != _digest(seqs[-1]["seq"]))}
        return self._entry_of(self.ex.add(self.d, entry)) or entry

    def _uncompiled(self, missing: list[int]) -> tuple[str, str] | None:
        """(how, why) when a missing peer has issued collectives past where this graph
        starts without proposing it (:func:`heartbeat`): it runs this stretch uncompiled
        (Dynamo skipped the frame on that rank, or it runs eager code there)."""
        for q in missing:
            theirs = self.ex.positions(q)
            for g, at in self.proposal["pos"].items():
                if at is not None and theirs.get(g, -1) > at:
                    return "runs uncompiled", (
                        f"rank {q} issued collective {theirs[g] - 1} of group {g} without "
                        f"compiling this graph, which starts at collective {at}: it runs "
                        "this stretch uncompiled (Dynamo skipped the frame there, or it is "
                        "eager code on that rank)")
        return None

    def _fallback(self, closure: set[int], how: str, why: str) -> dict:
        """The program's own order for ``closure``: right however each rank cuts the
        program, and untagged unless a rank runs a rewritten graph of the function
        (``ranks.tag``): then it pairs with whatever a peer runs at that place exactly as
        plain ``torch.compile``'s graphs would."""
        last = program_step(self.steps)
        entry = {"ranks": sorted(closure), "step": last, "nosymm": last, "ws": 0, "how": how,
                 "why": why, "differences": [why] if how == "program differs" else []}
        if how == "program differs" and self.check_ranks:
            entry["error"] = why
        return entry

    def _evidence(self, closure: set[int]) -> tuple[str, str] | None:
        """(how, why) when a peer's own graphs show it will not compile this one here: one
        of them starts where this one does, or covers where it starts."""
        pos = self.proposal["pos"]
        firsts = {g: _first(self.program, g) for g in pos}
        for q in sorted(closure - {self.rank}):
            for line in _folded(self.ex.notes(q)):
                if line["d"] == self.d:
                    continue
                for g, at in pos.items():
                    theirs = line["pos"].get(g)
                    if at is None or theirs is None:
                        continue
                    if theirs == at:
                        a, b = firsts[g], line["first"].get(g)
                        if a is not None and b is not None and a != b:
                            return "program differs", (
                                f"at collective {at} of group {g}, rank {self.rank} issues {a}, "
                                f"rank {q} issues {b}")
                        return "cut differently", (
                            f"rank {q} compiles another graph from collective {at} of group "
                            f"{g}{_where(line) or self._own_cut()}")
                    issued = line.get("m", {}).get(g)
                    if theirs < at and issued is not None and theirs + issued > at:
                        return "cut differently", (
                            f"rank {q} runs collectives {theirs}-{theirs + issued - 1} of group "
                            f"{g} in another graph{_where(line) or self._own_cut()}")
        return None

    def _own_cut(self) -> str:
        return f": this rank cut its graph at {self.cut}" if self.cut else ""

    def agreement(self, entry: dict, how: str, waited: float) -> Agreement:
        return Agreement(compared=True, step=self.steps[entry["step"]].label, how=how,
                         differences=list(entry.get("differences", [])), waited_s=waited,
                         ranks=list(entry["ranks"]), why=entry.get("why", ""))

    def noted(self, texts: list[str]) -> None:
        """Note how many collectives this graph issues on each group (peers' evidence)."""
        counts: dict[str, int] = {}
        for t in texts:
            role = t.split(":", 1)[0]
            counts[role] = counts.get(role, 0) + 1
        m = {g: counts.get(self.canon.role(g), 0) for g in self.proposal["pos"]}
        self.ex.note({"d": self.d, "pos": self.proposal["pos"], "m": m})


def _where(line: dict) -> str:
    """Where a peer's note says it cut its graph, as a clause ("" when it did not say)."""
    return f": it cut its graph at {line['cut']}" if line.get("cut") else ""


def _closure(proposals: dict[int, dict]) -> set[int]:
    """Every rank of every group of the known proposals (peers' groups too)."""
    return {r for p in proposals.values() for _, ranks in p["groups"] for r in ranks}


def _folded(lines: list[dict]) -> list[dict]:
    """A rank's notes, one per graph: the proposal's line with its decided counts."""
    out: dict[tuple, dict] = {}
    for line in lines:
        key = (line["d"], json.dumps(line["pos"], sort_keys=True))
        out.setdefault(key, {"first": {}}).update(line)
    return list(out.values())


_HAZARD = (". If a peer already runs this stretch of the program rewritten (this rank "
           "recompiled it, cut into other graphs), their collectives cannot pair: with "
           "Config.run_checks (the default) the first such collective raises "
           "CollectiveMismatchError on every rank; without, such a program needs "
           "Config(passes=('schedule',)) or plain torch.compile")
