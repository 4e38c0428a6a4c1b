"""Run one ATen FX graph per rank in one process, all_reduces matched across ranks.

Each rank's graph runs node by node on real tensors as a generator. An all_reduce is
*issued* (the rank goes on) and its ``wait_tensor`` blocks until it is reduced: the driver
pairs collectives, reduces the ranks' inputs elementwise in rank order, and resumes the
ranks that wait. A rank's collectives complete in its issue order (as on one NCCL stream),
so a rank that issues on group A then B pairs B only after A: cross-group wait cycles are
deadlocks, whatever the groups.

Groups (``groups``: name -> member ranks; a name not given spans every rank): the k-th
collective a rank issues on g pairs with the k-th collective every other member issues on g
(what c10d does: per-group issue order). Paired collectives must have one
:class:`Signature` (op, group, dtype, shape), else :class:`CollectiveMismatch` (gloo/NCCL:
garbage or a hang). If no collective can pair while some rank waits, the ranks deadlock (a
cross-group wait cycle, or a rank that finished while its peers wait): also
:class:`CollectiveMismatch`. With one group, or groups that all span every rank, every rank
issues one sequence.

A rank may run a :class:`Chain` of graphs instead of one (a program cut into graphs by graph
breaks): the parts run in turn, values crossing a cut passed on as outputs of one part and
inputs of the next; and a :class:`Job` of such steps, one after the other (the life of a
job: rank-local recompiles and re-cuts between steps). A rank whose run-time tag check
fails (``ranks.tag``) stops there, loudly: ``Simulation.raised``.

    b = GraphBuilder()
    x = b.input("x", (2, 2))
    gm = b.build(b.add(b.all_reduce(x), x))
    sim = simulate([gm, gm], [[torch.ones(2, 2)], [torch.full((2, 2), 2.0)]])
    sim.outputs[1]      # (tensor([[5., 5.], [5., 5.]]),)   AR = 1 + 2, plus rank 1's 2
    sim.issued          # [Signature(op="sum", group="0", dtype=torch.float32, shape=(2, 2))]
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule
from torch.fx.node import map_arg

from fxcoalesce.collectives import ALL_REDUCE, ALL_REDUCE_, WAIT, is_collective, op_of

REDUCE = {"sum": torch.add, "avg": torch.add, "product": torch.mul,
          "max": torch.maximum, "min": torch.minimum}


@dataclass(frozen=True, slots=True)
class Signature:
    """What ranks must agree on for one all_reduce (functional or in place: same message)."""

    op: str
    group: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"all_reduce({self.op}, group {self.group}) {dtype}{list(self.shape)}"


@dataclass(slots=True)
class Simulation:
    outputs: list[tuple]
    """Each rank's graph outputs."""
    issued: list[Signature]
    """The all_reduces that fired, in firing order (each once, for all members of its group)."""
    by_rank: list[list[Signature]] = field(default_factory=list)
    """The all_reduces each rank issued, in its order."""
    raised: dict[int, int] = field(default_factory=dict)
    """Ranks whose tag check failed (``ranks.tag``): the firing index each had paired last."""
    stuck: list[int] = field(default_factory=list)
    """Ranks left waiting (for a rank in ``raised``) when the run ended."""
    members: list[list[int]] = field(default_factory=list)
    """The ranks each firing paired, in firing order."""
    returned: list[list] = field(default_factory=list)
    """Per rank, the outputs of each :class:`Job` step it returned (all of them, or those
    before the step where it stopped)."""
    ends: list[list[int]] = field(default_factory=list)
    """Per rank, for each step it returned: the firing index it had paired last by then."""
    failed: dict[int, int] = field(default_factory=dict)
    """Ranks in ``raised``: the firing index of the all_reduce whose tag check failed."""


@dataclass(frozen=True, slots=True)
class Chain:
    """One rank's program cut into graphs: ``parts[j]`` takes the rank's inputs followed by
    the first ``carries[j - 1]`` outputs of ``parts[j - 1]`` (values crossing the cut); its
    other outputs are final. ``order[i]``: where the i-th final output (parts in turn) goes in
    the program's output tuple."""

    parts: tuple[GraphModule, ...]
    carries: tuple[int, ...]
    order: tuple[int, ...]


class CollectiveMismatch(AssertionError):
    """Ranks reached different collectives at the same step (or some ranks ran out)."""


RankRun = Generator[tuple, object, tuple]


@dataclass(slots=True)
class _Pending:
    """An issued all_reduce: its input, and once its group's members all issued it, the
    reduced value (``wait_tensor`` on it blocks until then)."""

    sig: Signature
    x: torch.Tensor
    inplace: bool
    result: torch.Tensor | None = None
    index: int = -1  # its firing index, once paired


def run_rank(gm: GraphModule, inputs: Sequence[torch.Tensor]) -> RankRun:
    """Interpret ``gm`` on ``inputs``. At an all_reduce, yield ("issue", pending) and go on
    (it is in flight); at its ``wait_tensor``, yield ("wait", pending) until it is reduced.
    Return the outputs. A tag check that fails (``ranks.tag``) raises from here."""
    env = {}
    args = iter(inputs)
    for n in gm.graph.nodes:
        a, kw = map_arg((n.args, n.kwargs), env.__getitem__)
        if n.op == "placeholder":
            env[n] = next(args)
        elif n.op == "output":
            return tuple(a[0])
        elif n.op != "call_function":
            raise NotImplementedError(f"{n.op} node {n.name}")
        elif op_of(n) in (ALL_REDUCE, ALL_REDUCE_):
            x, op, group = a[0], a[1], a[2]
            pending = _Pending(Signature(op, group, x.dtype, tuple(x.shape)), x,
                               op_of(n) is ALL_REDUCE_)
            yield "issue", pending
            env[n] = pending
        elif op_of(n) is WAIT:
            pending = a[0]
            if isinstance(pending, _Pending):
                while pending.result is None:
                    yield "wait", pending
                env[n] = pending.x if pending.inplace else pending.result
            else:
                env[n] = pending
        elif is_collective(n):
            raise NotImplementedError(f"collective {n.target} ({n.name})")
        else:
            try:
                env[n] = op_of(n)(*a, **kw)
            except RuntimeError as e:
                if is_check_error(e):
                    e.checked = _checked(n, env)  # the collective whose tag failed
                raise
    raise AssertionError("graph has no output node")


def _checked(check, env) -> _Pending | None:
    """The all_reduce a tag check reads: the first ``wait_tensor`` up its inputs."""
    seen, todo = set(), [check]
    while todo:
        n = todo.pop(0)
        if n.op == "call_function" and op_of(n) is WAIT and isinstance(env.get(n.args[0]),
                                                                        _Pending):
            return env[n.args[0]]
        for m in n.all_input_nodes:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return None


def run_chain(chain: Chain, inputs: Sequence[torch.Tensor]) -> RankRun:
    """:func:`run_rank` over the parts of ``chain`` in turn."""
    carry: list = []
    finals: list = []
    for gm, c in zip(chain.parts, chain.carries, strict=True):
        outs = yield from run_rank(gm, [*inputs, *carry])
        carry, finals = list(outs[:c]), finals + list(outs[c:])
    out = [None] * len(finals)
    for i, at in enumerate(chain.order):
        out[at] = finals[i]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Job:
    """One rank's job: ``steps[i]`` (a graph or a :class:`Chain`) runs on the rank's inputs
    after ``steps[i - 1]`` has returned; the job's outputs are each step's."""

    steps: tuple


def run_job(job: Job, inputs: Sequence[torch.Tensor], done: list) -> RankRun:
    """The steps in turn, each on fresh copies of ``inputs``; each step's outputs go to
    ``done`` as it returns (so a rank that stops later keeps what it returned before)."""
    for g in job.steps:
        done.append((yield from _runner(g, inputs)))
    return tuple(done)


def _runner(g, inputs, done: list | None = None) -> RankRun:
    fresh = [t.clone() for t in inputs]
    if isinstance(g, Job):
        return run_job(g, inputs, [] if done is None else done)
    return run_chain(g, fresh) if isinstance(g, Chain) else run_rank(g, fresh)


def reduce(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise reduction in rank order (so the result never depends on tensor layout)."""
    out = functools.reduce(REDUCE[op], tensors)
    return out / len(tensors) if op == "avg" else out


def describe(heads: dict[int, Signature | None], ranks: Sequence[int]) -> str:
    """Which ranks issue what: "ranks [0, 2] issue all_reduce(sum, group 0) float32[4];
    ranks [1] issue ..."."""
    by_sig: dict[str, list[int]] = {}
    for r in ranks:
        sig = heads.get(r)
        by_sig.setdefault(str(sig) if sig is not None else "nothing (finished)", []).append(r)
    return "; ".join(f"ranks {ranks} issue {what}" for what, ranks in by_sig.items())


def is_check_error(e: BaseException) -> bool:
    """A tag check's error (``ranks.tag``): a rank that stops on it stops loudly."""
    from fxcoalesce.ranks.tag import MESSAGE_START

    return isinstance(e, RuntimeError) and MESSAGE_START in str(e)


def simulate(gms: Sequence, inputs: Sequence[Sequence[torch.Tensor]],
             groups: dict[str, Sequence[int]] | None = None) -> Simulation:
    """Run ``gms[r]`` (a graph, a :class:`Chain` or a :class:`Job`) on ``inputs[r]`` for
    every rank r, all_reduces paired per group (module docstring); raise
    :class:`CollectiveMismatch` at the first pairing of different collectives, or where no
    rank can go on (deadlock). A rank whose tag check fails stops there: it is in
    ``Simulation.raised`` (the collective it had paired last), and ranks left waiting for it
    are not a deadlock."""
    world = len(gms)
    every = list(range(world))
    groups = {g: sorted(m) for g, m in (groups or {}).items()}
    returned: list[list] = [[] for _ in every]  # a Job's steps, as they return
    ends: list[list[int]] = [[] for _ in every]
    ranks = [_runner(g, inp, returned[r]) for r, (g, inp) in enumerate(zip(gms, inputs,
                                                                            strict=True))]
    outputs: list = [None] * world
    issued: list[Signature] = []
    by_rank: list[list[Signature]] = [[] for _ in every]
    queues: dict[tuple[int, str], list[_Pending]] = {}  # (rank, group) -> issued, unpaired
    blocked: dict[int, _Pending] = {}
    raised: dict[int, int] = {}
    failed: dict[int, int] = {}
    last: dict[int, int] = {}  # rank -> the firing index it was last paired in
    live = set(every)

    order: list[list[_Pending]] = [[] for _ in every]  # each rank's unpaired, issue order
    paired: list[list[int]] = []

    def step_ended(r: int) -> None:
        ends[r] += [last.get(r, -1)] * (len(returned[r]) - len(ends[r]))

    def advance(r: int) -> None:
        """Run rank r until it waits for an unreduced collective, ends, or raises."""
        try:
            while True:
                what, pending = next(ranks[r])
                step_ended(r)
                if what == "issue":
                    queues.setdefault((r, pending.sig.group), []).append(pending)
                    order[r].append(pending)
                elif pending.result is None:
                    blocked[r] = pending
                    return
        except StopIteration as done:
            step_ended(r)
            outputs[r] = done.value
            live.discard(r)
        except Exception as e:  # noqa: BLE001 - a failed tag check stops this rank only
            if not is_check_error(e):
                raise
            raised[r] = last.get(r, -1)
            pending = getattr(e, "checked", None)
            failed[r] = -1 if pending is None else pending.index
            live.discard(r)

    def head(m: int, g: str) -> _Pending | None:
        """Member m's next collective on g, if it is m's oldest unpaired one (a rank's
        collectives complete in its issue order, as on one stream)."""
        q = queues.get((m, g))
        return q[0] if q and order[m] and order[m][0] is q[0] else None

    for r in every:
        advance(r)
    while live:
        fired = False
        for g in sorted({g for (_, g) in queues}):
            members = groups.get(g, every)
            if not all(head(m, g) is not None for m in members):
                continue
            heads = {m: queues[(m, g)][0] for m in members}
            if len({h.sig for h in heads.values()}) > 1:
                raise CollectiveMismatch(f"collective #{len(issued)}: " + describe(
                    {m: h.sig for m, h in heads.items()}, members))
            sig = heads[members[0]].sig
            result = reduce(sig.op, [heads[m].x for m in members])
            index = len(issued)
            issued.append(sig)
            paired.append(list(members))
            for m in members:
                queues[(m, g)].pop(0)
                order[m].pop(0)
                pending = heads[m]
                pending.index = index
                pending.result = result.clone()
                if pending.inplace:
                    pending.x.copy_(result)
                by_rank[m].append(sig)
                last[m] = index
            fired = True
            for m in members:
                if blocked.get(m) is not None and blocked[m].result is not None:
                    del blocked[m]
                    advance(m)
        if not fired:
            waiting = sorted(live)
            if raised:  # the ranks left wait for a rank that stopped on its check
                break
            heads = {r: (order[r][0].sig if order[r] else None) for r in every}
            raise CollectiveMismatch(f"collective #{len(issued)}: deadlock: "
                                     + describe(heads, waiting))
    return Simulation(outputs, issued, by_rank, raised, sorted(live), paired, returned, ends,
                      failed)


def assert_loud(sim: Simulation) -> None:
    """Where some rank's tag check failed, every member of the pairing whose check failed
    stopped on a check too, or waits with that check still to run (it fails: the tags
    differ on every member); none returned a step after that pairing. A member may have
    stopped on another pairing: before this one, with this collective in flight (seed
    3671131272: rank 0 stops on #8, rank 2 on #10, rank 0's next all_reduce), or on a
    collective it waited on first (seed 2850615131: rank 2 stops on #6, rank 0 waits on
    its #8 first and stops there)."""
    for r, k in sim.failed.items():
        assert k >= 0, f"rank {r} raised on a check of no paired collective"
        for m in sim.members[k]:
            assert m in sim.raised or m in sim.stuck, f"rank {m} paired #{k} wrongly, went on"
            assert all(e < k for e in sim.ends[m]), (
                f"rank {m} returned a step after pairing #{k} wrongly", sim.raised, sim.ends)
