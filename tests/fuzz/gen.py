"""Fuzz programs as Python source text, from a seed: ``generate(seed, world)`` draws every
choice from ``random.Random(seed)`` alone, so a seed and a world size give the same text
every time. Each program is a whole script that one process per rank runs (it imports
``fuzz.harness`` for the group, the variant's compiler and the records).

A program is one compiled step function (sometimes a second, ``head``) called for some
steps, each step recorded. The step function is built from TP blocks (summed all_reduces,
independent pairs, chains, an all_gather beside an all_reduce) over one to three groups,
with *hooks* put between or after the collectives: rank-dependent logging, a helper
disabled on one rank, a read of a value only one rank changes (under a small recompile
limit). Around it: eager collectives between compiled calls, a KV cache updated in place,
sequence lengths that change, a process group made anew. ``Program.features`` names what
was drawn (``class.detail``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

OPS = ("sum", "avg", "max", "min")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Program:
    seed: int
    world: int
    text: str
    features: tuple[str, ...]
    inductor: bool
    steps: int

    @property
    def dtype(self) -> str:
        return next(f.split(".", 1)[1] for f in self.features if f.startswith("dtype."))

    def classes(self) -> tuple[str, ...]:
        return tuple(sorted({f.split(".")[0] for f in self.features}))


def default_world(seed: int) -> int:
    """The world size a sharded run gives ``seed``: 4 for about a third of the seeds."""
    return 4 if random.Random(seed * 2 + 1).random() < 0.3 else 2


@dataclass
class _Draw:
    rng: random.Random
    seed: int
    world: int
    features: set = field(default_factory=set)
    top: list = field(default_factory=list)  # module level, after groups and weights
    pre: list = field(default_factory=list)  # each step, before the recorded part
    body: list = field(default_factory=list)  # step_fn: lines, and ("slot", indent, loop)
    hooks: dict = field(default_factory=dict)  # slot index -> lines
    layers: int = 0  # weight layers used
    steps: int = 0

    def p(self, prob: float) -> bool:
        return self.rng.random() < prob

    def pick(self, *options, weights=None):
        return self.rng.choices(options, weights=weights)[0]

    def feature(self, name: str) -> None:
        self.features.add(name)

    def slot(self, indent: int, loop: bool) -> None:
        self.body.append(("slot", indent, loop))

    def hook(self, lines: list[str], loop_only: bool = False) -> None:
        """Put ``lines`` at a random slot of the step function (one in the layer loop when
        ``loop_only``)."""
        slots = [i for i, x in enumerate(self.body) if isinstance(x, tuple)
                 and (x[2] or not loop_only)]
        if slots:
            self.hooks.setdefault(self.rng.choice(slots), []).extend(lines)


def _op(d: _Draw) -> str:
    op = d.pick(*OPS, weights=(6, 1.5, 1.5, 1))
    if op != "sum":
        d.feature(f"op.{op}")
    return op


def _ar(expr: str, op: str, group: str) -> str:
    return f'funcol.all_reduce({expr}, "{op}", {group})'


def _block(d: _Draw, kind: str, layer: str, ind: int, loop: bool, groups: list[str]) -> None:
    """One TP block updating ``h`` (|h| < 1 after it), slots between its collectives."""
    s = " " * ind
    group = d.rng.choice(groups)
    if kind in ("sum", "sum3"):
        op = _op(d)
        ops = [op, op, op]
        if d.p(0.15):  # a sum of reductions of different ops: nothing to rewrite
            ops[1] = d.pick(*OPS)
            d.feature("tp.mixed_op")
        terms = ["h", "torch.sin(h)", "torch.cos(h) * 0.5"][: 3 if kind == "sum3" else 2]
        names = "abc"[: len(terms)]
        for j, (name, term) in enumerate(zip(names, terms)):
            d.body.append(f"{s}{name} = {_ar(f'{term} @ W[{layer}][{j}]', ops[j], group)}")
            if j < len(terms) - 1:
                d.slot(ind, loop)
        combo = d.pick(" + ".join(names), "a - b" + (" + c" if kind == "sum3" else ""),
                       "0.5 * a + " + " + ".join(names[1:]))
        d.body.append(f"{s}h = torch.tanh({combo})")
    elif kind == "bucket":
        other = d.rng.choice(groups) if d.p(0.3) else group
        d.body.append(f"{s}a = {_ar(f'h @ W[{layer}][0]', _op(d), group)}")
        d.slot(ind, loop)
        d.body.append(f"{s}b = {_ar(f'torch.cos(h) @ W[{layer}][1]', _op(d), other)}")
        d.body.append(f"{s}h = torch.tanh(0.5 * a + 0.25 * b)")
    elif kind == "chain":
        d.body.append(f"{s}h = torch.tanh({_ar(f'h @ W[{layer}][0]', _op(d), group)})")
    else:  # an all_gather of a slice beside an all_reduce
        d.body.append(f"{s}g = funcol.all_gather_tensor(h[..., : D // 2].contiguous(), 0, "
                      f"{d.rng.choice(groups)})")
        d.body.append(f"{s}a = {_ar(f'h @ W[{layer}][0]', _op(d), group)}")
        d.body.append(f"{s}m = g.reshape(-1, *h.shape[:-1], D // 2).mean(0)")
        d.body.append(f"{s}h = torch.tanh(a + 0.1 * torch.cat([m, m], -1))")
    d.slot(ind, loop)
    d.feature(f"tp.{kind}")


def _blocks(d: _Draw, groups: list[str], gather: bool) -> None:
    kinds = ["sum", "sum3", "bucket", "chain"] + (["gather"] if gather else [])
    weights = [4, 1, 3, 1.5] + ([1] if gather else [])
    n = d.pick(1, 2, 3, weights=(3, 4, 2))
    d.slot(4, False)
    if n > 1 and d.p(0.4):  # a Python loop over layers, one block each
        d.feature("tp.loop")
        d.body.append(f"    for i in range({n}):")
        _block(d, d.pick(*kinds, weights=weights), "i", 8, True, groups)
    else:
        for layer in range(n):
            _block(d, d.pick(*kinds, weights=weights), str(layer), 4, False, groups)
    d.layers = n


def _logging(d: _Draw) -> None:
    """Rank-dependent logging inside the compiled function, each form with a chance."""
    def emit(message: str) -> str:
        if d.p(0.4):
            d.feature("log.logging")
            return f"log.warning({message})"
        return f"print({message}{', flush=True' if d.p(0.2) else ''})"

    def rank() -> str:
        if d.p(0.4):
            d.feature("log.get_rank")
            return "dist.get_rank()"
        return "RANK"

    who = d.pick(0, d.world - 1, weights=(3, 1))
    n = d.pick(2, 3, 5)
    if d.p(0.2):
        d.feature("log.rank")
        d.hook([f"if {rank()} == {who}:", "    " + emit(f'f"rank {who} here at step {{step}}"')])
    if d.p(0.2):
        d.feature("log.every_n")
        d.hook([f"if {rank()} == {who} and step % {n} == 0:",
                "    " + emit(f'f"step {{step}}: every {n} steps"')])
    if d.p(0.15) and any(isinstance(x, tuple) and x[2] for x in d.body):
        d.feature("log.loop")
        d.hook([f"if {rank()} == {who} and i == {d.pick(0, 1)}:",
                "    " + emit('f"layer {i} at step {step}"')], loop_only=True)
    if d.p(0.15):
        d.feature("log.helper")
        d.top += ["def note(step, msg):", f"    if {rank()} == {who} and step % {n} == 0:",
                  "        " + emit("msg"), ""]
        d.hook(['note(step, f"a helper logs at step {step}")'])
    if d.p(0.15):
        d.feature("log.flag")
        d.top += ["class Flags:", "    verbose = False", "", "", "CFG = Flags()", ""]
        at = d.rng.randrange(d.steps)
        cond = d.pick(f"step == {at}", f"step >= {at}")
        d.pre.append(f"CFG.verbose = RANK == {who} and {cond}")
        d.hook(["if CFG.verbose:", "    " + emit('f"verbose at step {step}"')])


def _rank_local(d: _Draw, groups: list[str]) -> None:
    """A helper disabled on one rank; a value one rank changes under a small recompile
    limit."""
    who = d.pick(0, d.world - 1)
    if d.p(0.15):
        collective = d.p(0.5)
        d.feature("disable." + ("collective" if collective else "compute"))
        inner = _ar("h * 0.5", "sum", d.rng.choice(groups)) if collective else "h * 1.5"
        d.top += ["def mix(h):", f"    return torch.tanh({inner})", "", "",
                  f"if RANK == {who}:", "    mix = torch.compiler.disable(mix)", ""]
        d.hook(["h = mix(h)"])
    if d.p(0.12):
        d.feature("recompile.limit")
        limit = d.pick(1, 2, 3)
        d.top += ["_dynamo_config = torch._dynamo.config",
                  "if hasattr(_dynamo_config, 'recompile_limit'):",
                  f"    _dynamo_config.recompile_limit = {limit}",
                  "else:  # its name before torch 2.13",
                  f"    _dynamo_config.cache_size_limit = {limit}", 'PHASE = "p"', ""]
        d.pre += [f"if RANK == {who}:", '    PHASE = f"p{step}"']
        d.hook(["h = h * (1.0 + 0.0 * len(PHASE))"])


def _groups(d: _Draw) -> tuple[list[str], list[str]]:
    extra = d.pick(0, 1, 2, weights=(4, 4, 2))
    d.feature(f"groups.{extra + 1}")
    lines = ["def make_groups():", "    global G0, G1, G2", "    w = dist.get_world_size()",
             "    G0 = dist.group.WORLD",
             "    G1 = H.subgroup(H.halves(w))  # every rank makes every group, in order",
             "    G2 = H.subgroup(H.strided(w))"]
    return ["G0", "G1", "G2"][: extra + 1], lines[: 4 + extra]


def generate(seed: int, world: int, inductor: bool | None = None) -> Program:
    d = _Draw(random.Random(seed), seed, world)
    dtype = d.pick(*DTYPES, weights=(2, 1, 1))
    d.feature(f"dtype.{dtype}")
    r = d.rng.random()
    d.steps = d.rng.randint(3, 8) if r < 0.8 else d.rng.randint(12, 40) if r < 0.96 else \
        d.rng.randint(100, 300)
    if d.steps > 8:
        d.feature("steps.long" if d.steps >= 100 else "steps.many")
    regroup = None
    if d.p(0.15):
        at = d.rng.randint(1, d.steps - 1)
        size = d.pick(world, world // 2)
        regroup = (at, size)
        d.feature("regroup." + ("same" if size == world else "smaller"))
    groups, group_lines = _groups(d)
    _blocks(d, groups, gather=regroup is None or regroup[1] == world)
    seq = "4"
    if d.p(0.35):
        d.feature("dynamic.seq")
        seq = f"3 + step % {d.pick(2, 3)}"
    kw = ""
    if d.p(0.15):
        d.feature("dynamic.true")
        kw = ", dynamic=True"
    if d.p(0.3):
        if d.p(0.5):
            d.feature("kv.setitem")
            d.body += ["    CACHE[:, pos] = h[:, -1]",
                       "    h = h + 0.5 * CACHE[:, : pos + 1].mean(1, keepdim=True)"]
        else:
            d.feature("kv.index_copy")
            d.body += ["    CACHE.index_copy_(1, idx, h[:, -1:])",
                       "    h = h + 0.5 * CACHE.mean(1, keepdim=True)"]
        d.top += ["CACHE = torch.zeros(B, MAXT, D, dtype=DT)", ""]
    _logging(d)
    _rank_local(d, groups)
    head = d.p(0.25)
    if head:
        d.feature("compile.two_fns")
    drawn = d.p(0.1)  # drawn even when given: the text never depends on it (the runner's)
    inductor = drawn if inductor is None else inductor
    text = _render(d, dtype, group_lines, head, seq, kw, regroup)  # draws some features too
    if inductor:
        d.feature("compile.inductor")
    return Program(seed, world, text, tuple(sorted(d.features)), inductor, d.steps)


def _body(d: _Draw) -> list[str]:
    out = []
    for i, x in enumerate(d.body):
        if isinstance(x, tuple):
            out += [" " * x[1] + line for line in d.hooks.get(i, [])]
        else:
            out.append(x)
    return out


def _render(d: _Draw, dtype, group_lines, head, seq, kw, regroup) -> str:
    lines = [f"# fxcoalesce fuzz program: seed {d.seed}, world {d.world}",
             f"# features: {' '.join(sorted(d.features))}",
             (f"# replay: python benchmarks/fuzz_ranks.py --seed {d.seed} --world {d.world} "
              "--variant fxcoalesce -v"),
             "import logging", "", "import torch", "import torch.distributed as dist",
             "import torch.distributed._functional_collectives as funcol", "",
             "import fuzz.harness as H", "",
             "RANK, WORLD = H.init()", f"SEED = {d.seed}", f"DT = torch.{dtype}",
             "B, D, MAXT = 2, 8, 8", 'log = logging.getLogger("fuzz")', "", "",
             *group_lines, "", "", "make_groups()",
             f"W = H.weights(SEED, RANK, {d.layers + head}, 3, D, DT)", "", *d.top, "",
             "def step_fn(x, step, pos, idx):", "    h = x", *_body(d), "    return h", ""]
    if head:
        lines += ["", "def head(h):",
                  f"    z = {_ar(f'h.mean(1) @ W[{d.layers}][0]', 'sum', 'G0')}",
                  "    return torch.tanh(z)", "", ""]
    lines += [f"f = H.compile(step_fn{kw})"] + (["g = H.compile(head)"] if head else [])
    lines += [f"for step in range({d.steps}):"]
    lines += ["    " + x for x in d.pre]
    lines += ["    with H.step(step) as rec:"]
    if regroup:
        lines += [f"        if step == {regroup[0]}:  # a process group made anew",
                  f"            H.regroup({regroup[1]})", "            make_groups()"]
    lines += [f"        x = H.randn(SEED, step, RANK, (B, {seq}, D), DT)",
              "        out = f(x, step, step % MAXT, torch.tensor([step % MAXT]))",
              '        rec.out("out", out)']
    if head:
        lines += ['        rec.out("head", g(out))']
    if d.p(0.4):
        d.feature("eager.all_reduce")
        lines += ["        loss = out.float().sum().reshape(1)", "        dist.all_reduce(loss)",
                  '        rec.out("loss", loss, scale=out.float().abs().sum() * '
                  'dist.get_world_size())']
    if d.p(0.25):
        d.feature("eager.broadcast")
        lines += ["        metric = out.float().abs().mean().reshape(1)",
                  "        dist.broadcast(metric, src=0)", '        rec.out("metric", metric)']
    lines += ["H.finish()", ""]
    lines[1] = f"# features: {' '.join(sorted(d.features))}"
    return "\n".join(lines)
