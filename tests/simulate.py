"""Run one ATen FX graph per rank in one process, all_reduces matched across ranks in lockstep.

Each rank's graph runs node by node on real tensors as a generator. At each all_reduce it
stops and hands the driver a :class:`Signature` and its input; the driver checks that every
rank stopped at the same signature (ranks pair collectives by issue order, so a difference
is what gloo/NCCL would turn into garbage or a hang), reduces the ranks' inputs elementwise
in rank order, and resumes every rank with the result. ``wait_tensor`` returns its input.
The simulation asks for one global sequence: stricter than real per-group pairing, and what
fxcoalesce promises.

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
from dataclasses import dataclass

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
    """The all_reduces every rank issued, in order."""


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


def reduce(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise reduction in rank order (so the result never depends on tensor layout)."""
    out = functools.reduce(REDUCE[op], tensors)
    return out / len(tensors) if op == "avg" else out


def describe(stops: dict[int, tuple[Signature, torch.Tensor]], world: int) -> str:
    """Which ranks issue what: "ranks [0, 2] issue all_reduce(sum, group 0) float32[4];
    ranks [1] issue ..."."""
    by_sig: dict[str, list[int]] = {}
    for r in range(world):
        by_sig.setdefault(str(stops[r][0]) if r in stops else "nothing (finished)", []).append(r)
    return "; ".join(f"ranks {ranks} issue {what}" for what, ranks in by_sig.items())


def simulate(gms: Sequence[GraphModule], inputs: Sequence[Sequence[torch.Tensor]]
             ) -> Simulation:
    """Run ``gms[r]`` on ``inputs[r]`` for every rank r; raise :class:`CollectiveMismatch`
    at the first step where the ranks' collectives differ."""
    ranks = [run_rank(gm, [t.clone() for t in inp]) for gm, inp in zip(gms, inputs, strict=True)]
    outputs: list = [None] * len(ranks)
    issued: list[Signature] = []
    reply = [None] * len(ranks)
    while True:
        stops = {}
        for r, gen in enumerate(ranks):
            try:
                stops[r] = gen.send(reply[r])
            except StopIteration as done:
                outputs[r] = done.value
        if not stops:
            return Simulation(outputs, issued)
        step = len(issued)
        if len(stops) < len(ranks) or len({sig for sig, _ in stops.values()}) > 1:
            raise CollectiveMismatch(f"collective #{step}: " + describe(stops, len(ranks)))
        sig = stops[0][0]
        result = reduce(sig.op, [x for _, x in stops.values()])
        issued.append(sig)
        reply = [result.clone() for _ in ranks]
