"""Run one ATen FX graph per rank in one process, all_reduces matched across ranks in lockstep.

Each rank's graph runs node by node on real tensors as a generator. At each all_reduce it
stops and hands the driver a :class:`Signature` and its input; the driver checks that every
rank stopped at the same signature (ranks pair collectives by issue order, so a difference
is what gloo/NCCL would turn into garbage or a hang), reduces the ranks' inputs elementwise
in rank order, and resumes every rank with the result. ``wait_tensor`` returns its input.

Groups (``groups``: name -> member ranks; a name not given spans every rank). Collectives are
modelled as *blocking*: a rank stopped at a collective on group g waits until every member of
g is stopped at a collective on g; then those members *pair*: the k-th collective a rank
issues on g pairs with the k-th collective every other member issues on g (what c10d does:
per-group issue order). Paired collectives must have one :class:`Signature` (op, group,
dtype, shape), else :class:`CollectiveMismatch` (gloo/NCCL: garbage or a hang). If no group
can fire while some rank is stopped, the ranks deadlock (a cross-group wait cycle, or a rank
that finished while its peers wait): also :class:`CollectiveMismatch`. A run that passes is
exactly one where some global order of collectives exists whose restriction to each rank's
groups is what that rank issues (blocking firing is confluent: the order in which groups
fire changes neither pairing nor values). With one group, or groups that all span every
rank, this is the old global lockstep: every rank issues one sequence.

A rank may run a :class:`Chain` of graphs instead of one (a program cut into graphs by graph
breaks): the parts run in turn, values crossing a cut passed on as outputs of one part and
inputs of the next.

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


RankRun = Generator[tuple[Signature, torch.Tensor], torch.Tensor, tuple]


def run_rank(gm: GraphModule, inputs: Sequence[torch.Tensor]) -> RankRun:
    """Interpret ``gm`` on ``inputs``; yield (signature, input) at each all_reduce and take
    the reduced tensor back; return the outputs."""
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
            reduced = yield Signature(op, group, x.dtype, tuple(x.shape)), x
            env[n] = x.copy_(reduced) if op_of(n) is ALL_REDUCE_ else reduced
        elif op_of(n) is WAIT:
            env[n] = a[0]
        elif is_collective(n):
            raise NotImplementedError(f"collective {n.target} ({n.name})")
        else:
            env[n] = op_of(n)(*a, **kw)
    raise AssertionError("graph has no output node")


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


def reduce(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise reduction in rank order (so the result never depends on tensor layout)."""
    out = functools.reduce(REDUCE[op], tensors)
    return out / len(tensors) if op == "avg" else out


def describe(stops: dict[int, tuple[Signature, torch.Tensor]], ranks: Sequence[int]) -> str:
    """Which ranks issue what: "ranks [0, 2] issue all_reduce(sum, group 0) float32[4];
    ranks [1] issue ..."."""
    by_sig: dict[str, list[int]] = {}
    for r in ranks:
        by_sig.setdefault(str(stops[r][0]) if r in stops else "nothing (finished)", []).append(r)
    return "; ".join(f"ranks {ranks} issue {what}" for what, ranks in by_sig.items())


def simulate(gms: Sequence[GraphModule | Chain], inputs: Sequence[Sequence[torch.Tensor]],
             groups: dict[str, Sequence[int]] | None = None) -> Simulation:
    """Run ``gms[r]`` on ``inputs[r]`` for every rank r, all_reduces paired per group (module
    docstring); raise :class:`CollectiveMismatch` at the first pairing of different
    collectives, or where no group can go on (deadlock)."""
    world = len(gms)
    every = list(range(world))
    groups = {g: sorted(m) for g, m in (groups or {}).items()}
    ranks = [run_chain(gm, [t.clone() for t in inp]) if isinstance(gm, Chain)
             else run_rank(gm, [t.clone() for t in inp]) for gm, inp in zip(gms, inputs, strict=True)]
    outputs: list = [None] * world
    issued: list[Signature] = []
    by_rank: list[list[Signature]] = [[] for _ in every]
    stops: dict[int, tuple[Signature, torch.Tensor]] = {}

    def advance(r: int, reply) -> None:
        try:
            stops[r] = ranks[r].send(reply)
        except StopIteration as done:
            outputs[r] = done.value

    for r in every:
        advance(r, None)
    while stops:
        step = len(issued)
        ready = None
        for r in sorted(stops):
            g = stops[r][0].group
            members = groups.get(g, every)
            if all(m in stops and stops[m][0].group == g for m in members):
                ready = members
                break
        if ready is None:  # nothing can fire: a wait cycle across groups, or a rank ran out
            involved = sorted({m for r in stops for m in groups.get(stops[r][0].group, every)})
            raise CollectiveMismatch(f"collective #{step}: deadlock: "
                                     + describe(stops, involved))
        if len({stops[m][0] for m in ready}) > 1:
            raise CollectiveMismatch(f"collective #{step}: " + describe(stops, ready))
        sig = stops[ready[0]][0]
        result = reduce(sig.op, [stops[m][1] for m in ready])
        issued.append(sig)
        for m in ready:
            by_rank[m].append(sig)
            del stops[m]
            advance(m, result.clone())
    return Simulation(outputs, issued, by_rank)
