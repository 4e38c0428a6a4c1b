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

The classes of issue 49 (``CLASSES``) are drawn from a second generator, ``_side(seed)``, each
with a small chance, so that a seed that draws none of them gives the text it gave before
they existed (the fixed seeds of ``tests/test_fuzz_ranks.py`` draw none); a seed that draws
one takes every detail of it from that generator too, so its other features mostly stay:

- ``threads``: two threads per rank, each with its own process group (``dist.new_group``
  over every rank, made by every rank in one order) and its own row count, calling the same
  compiled step function (two request streams), joined at each step;
- ``raise``: a user ``ValueError`` in the compiled function, before any collective (a
  shape check: one rank or every rank sends a bad input once) or after some (a flag every
  rank passes once), caught by the program, recorded (``rec.raised``) and the call made
  again with good input;
- ``regroup_then``: a process group made anew, then on one rank a print inside a loop
  (Dynamo skips the frame there), a recompile limit reached, or ``torch.compiler.disable``;
- ``dynint``: ``dynamic=True`` with branches on the int argument ``step`` and on the rank
  (``if RANK == 0 and (step + 1) % N == 0: print(...)``) for 30-200 steps.

Issue 50's token split (``split.forced``: the step function compiled with
``Config(token_split=True)``, its token-parallel stretches run in two staggered parts) is drawn
from a third generator (``SPLIT``), so that no other draw moves.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

OPS = ("sum", "avg", "max", "min")
DTYPES = ("float32", "float16", "bfloat16")
CLASSES = {"threads": 0.05, "raise": 0.06, "regroup_then": 0.05, "dynint": 0.05}
"""Issue 49's classes and the chance of each (drawn by ``_side``; threads leave
``regroup_then`` out: a thread's group does not survive the default group's end)."""


SPLIT = 0.12
"""The chance of ``split.forced``, drawn from ``random.Random(f"token split 0 {seed}")``
(a seed string under which none of the fixed seeds of ``tests/test_fuzz_ranks.py`` draws it:
their programs are those they were; one more fixed seed draws it)."""


def _side(seed: int) -> tuple[random.Random, set[str]]:
    """The second generator and the classes it draws for ``seed``. Its seed, a str (through
    SHA-512: the same in every process), is one under which none of the fixed seeds of
    ``tests/test_fuzz_ranks.py`` draws a class (their programs are those they were)."""
    rng = random.Random(f"issue 49 {seed}")
    drawn = {name for name, p in CLASSES.items() if rng.random() < p}
    if "threads" in drawn:
        drawn.discard("regroup_then")
    return rng, drawn


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
    side: random.Random | None = None  # issue 49's classes draw from this one (``_side``)
    classes: set = field(default_factory=set)  # those drawn
    params: list = field(default_factory=list)  # step_fn's parameters after idx
    late: list = field(default_factory=list)  # at the regroup step, after make_groups()
    then: tuple = ()  # regroup_then: (detail, rank, recompile limit)

    def p(self, prob: float) -> bool:
        return self.rng.random() < prob

    def pick(self, *options, weights=None):
        return self.rng.choices(options, weights=weights)[0]

    def feature(self, name: str) -> None:
        self.features.add(name)

    def slot(self, indent: int, loop: bool) -> None:
        self.body.append(("slot", indent, loop))

    def hook(self, lines: list[str], loop_only: bool = False, rng=None,
             after_collective: bool = False) -> None:
        """Put ``lines`` at a random slot of the step function (one in the layer loop when
        ``loop_only``; past the first collective when ``after_collective``), chosen by
        ``rng`` (default: the program's own)."""
        slots = [i for i, x in enumerate(self.body) if isinstance(x, tuple)
                 and (x[2] or not loop_only)]
        if after_collective:
            slots = slots[1:]  # the first slot is the body's first line, before any
        if slots:
            self.hooks.setdefault((rng or self.rng).choice(slots), []).extend(lines)


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
        # threads: the helper takes the calling thread's group (a module-level one would
        # carry both streams' collectives at once)
        arg = ", G0" if "threads" in d.classes else ""
        d.top += [f"def mix(h{arg}):", f"    return torch.tanh({inner})", "", "",
                  f"if RANK == {who}:", "    mix = torch.compiler.disable(mix)", ""]
        d.hook([f"h = mix(h{arg})"])
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


def _regroup_then(d: _Draw, regroup: tuple | None) -> tuple[int, int]:
    """``regroup_then``: the group made anew (drawn here where the program drew none; a
    group of two ranks at least), and what one rank of it does differently from then on;
    enough steps after it for that (a recompile limit: a recompile a step)."""
    x = d.side
    at, size = regroup or (x.randint(1, min(3, d.steps - 1)), x.choice((d.world, d.world // 2)))
    size = size if size >= 2 else d.world
    detail = x.choice(("skip", "limit", "disable", "disable_collective"))
    limit = x.choice((3, 4))
    d.then = (detail, x.randrange(size), limit)
    d.steps = max(d.steps, at + (limit + 3 if detail == "limit" else 3))
    return at, size


def _regroup_then_body(d: _Draw) -> None:
    """``regroup_then``'s lines: a flag the regroup step sets, and what rank ``who`` does
    from then on (drawn in ``_regroup_then``)."""
    detail, who, limit = d.then
    x = d.side
    d.feature(f"regroup_then.{detail}")
    d.top += ["AFTER = False  # the group was made anew", ""]
    d.late.append("AFTER = True")
    if detail == "skip":  # a print in a loop: Dynamo skips the frame on that rank
        message = f'print(f"rank {who}: a new group at step {{step}}")'
        if any(isinstance(b, tuple) and b[2] for b in d.body):
            d.hook([f"if AFTER and RANK == {who} and i == {x.choice((0, 1))}:",
                    "    " + message], loop_only=True, rng=x)
        else:
            d.hook(["for j in range(2):", f"    if AFTER and RANK == {who} and j == 1:",
                    "        " + message], rng=x)
    elif detail == "limit":  # a value only that rank changes, a recompile each step
        d.top += ["_dynamo_config = torch._dynamo.config",
                  "if hasattr(_dynamo_config, 'recompile_limit'):",
                  f"    _dynamo_config.recompile_limit = {limit}",
                  "else:  # its name before torch 2.13",
                  f"    _dynamo_config.cache_size_limit = {limit}", 'LATE = "p"', ""]
        d.pre += [f"if AFTER and RANK == {who}:", '    LATE = f"p{step}"']
        d.hook(["h = h * (1.0 + 0.0 * len(LATE))"], rng=x)
    else:  # a helper disabled on that rank from then on
        inner = _ar("h * 0.5", "sum", "G0") if detail == "disable_collective" else "h * 1.25"
        d.top += ["def renewed(h):", f"    return torch.tanh({inner})", "", ""]
        d.late += [f"if RANK == {who}:", "    renewed = torch.compiler.disable(renewed)"]
        d.hook(["if AFTER:", "    h = renewed(h)"], rng=x)


def _dynint(d: _Draw) -> None:
    """``dynint``: under dynamic=True, a print on one rank every N steps (a branch on the
    int argument and on the rank), sometimes a branch on an int argument on every rank."""
    x = d.side
    who = x.choice((0, 0, 0, d.world - 1))
    n = x.choice((3, 5, 7, 10, 16, 25))
    rank = x.choice(("RANK", "RANK", "dist.get_rank()"))
    d.feature("dynint.rank_every")
    d.hook([f"if {rank} == {who} and (step + 1) % {n} == 0:",
            f'    print(f"rank {who}: step {{step}}, every {n} steps")'], rng=x)
    if x.random() < 0.5:
        d.feature("dynint.int_branch")
        m = x.choice((2, 3, 4))
        cond = x.choice((f"step % {m} == {m - 1}", f"pos >= {x.choice((2, 4, 6))}"))
        d.hook([f"if {cond}:", "    h = torch.tanh(h * 1.5)"], rng=x)


def _raise(d: _Draw) -> dict:
    """``raise``: a ValueError the compiled function raises for a bad request, before any
    collective (a shape check; one rank or every rank sends the bad input) or after some
    (a flag every rank passes: one rank alone would pair its retry's collectives with its
    peers' next ones, under plain too). The program catches it, records it and calls again."""
    x = d.side
    where = "before" if x.random() < 0.6 else "after"
    who = x.randrange(d.world) if where == "before" and x.random() < 0.7 else None
    d.feature(f"raise.{where}")
    d.feature("raise.one_rank" if who is not None else "raise.every_rank")
    if where == "after":
        d.params.append("bad=False")
        d.hook(["if bad:  # a user's check after some collectives",
                '    raise ValueError(f"a bad request at step {step}")'],
               rng=x, after_collective=True)
    return {"where": where, "at": x.randrange(d.steps), "who": who}


def generate(seed: int, world: int, inductor: bool | None = None) -> Program:
    side, classes = _side(seed)
    d = _Draw(random.Random(seed), seed, world, side=side, classes=classes)
    dtype = d.pick(*DTYPES, weights=(2, 1, 1))
    d.feature(f"dtype.{dtype}")
    r = d.rng.random()
    d.steps = d.rng.randint(3, 8) if r < 0.8 else d.rng.randint(12, 40) if r < 0.96 else \
        d.rng.randint(100, 300)
    regroup = None
    if d.p(0.15):
        at = d.rng.randint(1, d.steps - 1)
        size = d.pick(world, world // 2)
        regroup = (at, size)
    # the classes below draw from ``side`` and leave the program's draws as they were
    drawn_regroup = regroup  # what the blocks' draws depend on, as before the classes
    if "threads" in classes:  # a stream's group would not outlive the default group
        regroup = None
    if "dynint" in classes:  # many calls of one dynamic graph: 30-200 steps
        d.steps = side.randint(30, 60) if side.random() < 0.7 else side.randint(61, 200)
    if "regroup_then" in classes:
        regroup = _regroup_then(d, regroup)
    if regroup:
        d.feature("regroup." + ("same" if regroup[1] == world else "smaller"))
    if d.steps > 8:
        d.feature("steps.long" if d.steps >= 100 else "steps.many")
    groups, group_lines = _groups(d)
    if "threads" in classes:  # each thread's own group stands for G0, G1 and G2 (_render)
        d.features -= {f for f in d.features if f.startswith("groups.")}
        d.feature("groups.1")
        group_lines = group_lines[:4]
    _blocks(d, groups, gather=drawn_regroup is None or drawn_regroup[1] == world)
    seq = "4"
    if d.p(0.35):
        d.feature("dynamic.seq")
        seq = f"3 + step % {d.pick(2, 3)}"
    kw = ""
    if d.p(0.15) or "dynint" in classes:
        d.feature("dynamic.true")
        kw = ", dynamic=True"
    if d.p(0.3):
        setitem = d.p(0.5)
        if "threads" in classes:  # a KV cache has one row count, not two streams' own
            pass
        elif setitem:
            d.feature("kv.setitem")
            d.body += ["    CACHE[:, pos] = h[:, -1]",
                       "    h = h + 0.5 * CACHE[:, : pos + 1].mean(1, keepdim=True)"]
        else:
            d.feature("kv.index_copy")
            d.body += ["    CACHE.index_copy_(1, idx, h[:, -1:])",
                       "    h = h + 0.5 * CACHE.mean(1, keepdim=True)"]
        if "threads" not in classes:
            d.top += ["CACHE = torch.zeros(B, MAXT, D, dtype=DT)", ""]
    _logging(d)
    if "threads" in classes:
        d.feature("threads.two_groups")
        d.params.append("G0")  # the calling thread's group, in place of the global
    _rank_local(d, groups)
    if "regroup_then" in classes:
        _regroup_then_body(d)
    if "dynint" in classes:
        _dynint(d)
    bad = _raise(d) if "raise" in classes else None
    head = d.p(0.25)
    if head:
        d.feature("compile.two_fns")
    if random.Random(f"token split 0 {seed}").random() < SPLIT:
        d.feature("split.forced")
        kw += ", split=True"
    drawn = d.p(0.1)  # drawn even when given: the text never depends on it (the runner's)
    inductor = drawn if inductor is None else inductor
    text = _render(d, dtype, group_lines, head, seq, kw, regroup, bad)  # draws features too
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


def _bad_call(bad: dict | None, args: str, cond: str, ind: str, name: str) -> list[str]:
    """``raise``: at its step, a bad request, its ValueError caught and recorded (plain
    raises it too), before the good one."""
    if not bad:
        return []
    if bad["where"] == "before":  # the input the function's check refuses
        call = f"f(x[..., : D // 2], {args})"
    else:  # the flag its check after some collectives refuses
        call = f"f(x, {args}, bad=True)"
    who = "" if bad["who"] is None else f" and RANK == {bad['who']}"
    return [f"{ind}if {cond}step == {bad['at']}{who}:  # a bad request, caught, then again",
            f"{ind}    try:", f"{ind}        {call}", f"{ind}    except ValueError as e:",
            f'{ind}        rec.raised("{name}", e)']


def _render(d: _Draw, dtype, group_lines, head, seq, kw, regroup, bad=None) -> str:
    threads = "threads" in d.classes
    params = "".join(f", {p}" for p in d.params)
    check = ["    if x.shape[-1] != D:  # a user's check, before any collective",
             '        raise ValueError(f"want {D} features, got {x.shape[-1]}")'] \
        if bad and bad["where"] == "before" else []
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
             f"W = H.weights(SEED, RANK, {d.layers + head}, 3, D, DT)", ""]
    if threads:
        rows = d.side.choice(((2, 3), (1, 4), (2, 5), (3, 2)))
        lines += ["# two request streams, each with its own rows and its own group (every rank",
                  "# makes both, in this order)",
                  "TG = [dist.new_group(list(range(WORLD))) for _ in range(2)]",
                  f"ROWS = {rows}", ""]
    body, top = _body(d), d.top
    if threads:  # the calling thread's group, G0 (a parameter), wherever G1 or G2 was drawn
        body, top = ([re.sub(r"\bG[12]\b", "G0", x) for x in xs] for xs in (body, top))
    lines += [*top, "", f"def step_fn(x, step, pos, idx{params}):", *check, "    h = x",
              *body, "    return h", ""]
    if head:
        lines += ["", "def head(h):",
                  f"    z = {_ar(f'h.mean(1) @ W[{d.layers}][0]', 'sum', 'G0')}",
                  "    return torch.tanh(z)", "", ""]
    lines += [f"f = H.compile(step_fn{kw})"] + (["g = H.compile(head)"] if head else [])
    if threads:
        args = "step, step % MAXT, torch.tensor([step % MAXT]), TG[t]"
        lines += ["", "",
                  "def request(step, t, rec):",
                  "    \"\"\"Stream t's request at this step, on its own thread.\"\"\"",
                  f"    x = H.randn(SEED, step, RANK + 64 * t, (ROWS[t], {seq}, D), DT)",
                  *_bad_call(bad, args, "t == 0 and ", "    ", "bad"),
                  f"    return f(x, {args})", "", ""]
    lines += [f"for step in range({d.steps}):"]
    lines += ["    " + x for x in d.pre]
    lines += ["    with H.step(step) as rec:"]
    if regroup:
        lines += [f"        if step == {regroup[0]}:  # a process group made anew",
                  f"            H.regroup({regroup[1]})", "            make_groups()"]
        lines += ["            " + x for x in d.late]
    if threads:
        lines += ["        out, out1 = H.threads(request, [(step, t, rec) for t in range(2)])",
                  '        rec.out("out", out)', '        rec.out("out1", out1)']
    else:
        args = "step, step % MAXT, torch.tensor([step % MAXT])"
        lines += [f"        x = H.randn(SEED, step, RANK, (B, {seq}, D), DT)",
                  *_bad_call(bad, args, "", "        ", "bad"),
                  f"        out = f(x, {args})",
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
