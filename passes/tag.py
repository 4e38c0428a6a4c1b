"""Run-time proof that peers issue the same collectives: a tag at the end of all_reduces.

The agreement (``agreement``) covers compiles; a rank can re-cut or recompile an agreed
graph later, alone, while its peers keep running the rewrite. Then, at run time, ranks'
collectives pair with different ones: silently wrong values when the sizes match, a gloo
abort or an NCCL hang when they do not. A tag makes such a pairing loud on every rank:

    before                                   after (tag t, world size W)
    %ar = all_reduce(%x, "sum", g)           %cat = cat([reshape(%x, [-1]), full([1], t)])
    %w  = wait_tensor(%ar)                   %ar  = all_reduce(%cat, "sum", g)
    %y  = add(%w, %r)                        %w   = wait_tensor(%ar)
                                             _assert_async(all(eq(%w[n:], W * t)), ...)
                                             %y   = add(view(%w[:n], shape(%x)), %r)

Which all_reduces carry a tag (:func:`plan`), for every graph whose ranks agree on it
(``agreement.must_compare``: peers exist and the passes could change the sequence):

- a graph that issues the program's own sequence: every tagged-kind all_reduce, tag
  :data:`PROGRAM_TAG`;
- a rewritten graph: in each of its groups, its first all_reduce there, tag
  ``rewrite_tag(key, digest)`` (a power of two other than the program's), whose check must
  pass before the graph issues anything more (the next collective reads it), except in a
  group whose collectives all come after such a check in a group holding all its ranks
  (:func:`checked_firsts`). That all_reduce must look like the program's first one of the
  group at that place (same kind, dtype, op and element count, and the same collectives of
  the group before it: :func:`compatible`); a step where it does not issues the program's
  own sequence instead.

Why that is enough (assuming, as ``agreement`` does, that the program issues the same
collectives on every rank): take the first point of a group's stream where two ranks issue
different collectives, tags included. Two graphs of the program's own order issue the same
collectives there, and two ranks that issued the same rewrite tag in that group before it
run the same rewritten graph, which issues the same collectives in the group on both; so
one rank starts the group's part of a rewritten graph there, and the other issues, at that
point of the program, either the program's own collective (tagged: the same element count,
by :func:`compatible`) or the first all_reduce of another rewritten graph in that group
(also tagged, also that count). The sizes match, so the transport pairs them, and both tags
differ: every rank of the pair fails its check at that collective, and the rewritten side
issues nothing more (its next collective reads the check). In a group whose collectives
all follow the check of a group holding its ranks, every rank of the group passed that
check, so all of them run this rewritten graph, which issues the same collectives there.
No wrong value reaches the user on any rank. (Per group, not per graph: a graph over a TP
group and the world group whose first tag, in the TP group, paired with a peer running the
same rewrite can still meet, in the world group, a rank that re-cut alone: the
life-of-the-job property test found it, seed 1072165311.)

Tag values are powers of two whose exponents are multiples of ``c = ceil(log2 W) + 1`` (the
program's own is 2**0): W of them sum to W times one of them only if all are that one (as
digits in base 2**c, each count at most W < 2**c), and rounding in a float dtype with at
least 8 significand bits cannot close the gap (the lower digits add less than half the top
one), so every rank's one comparison decides, in floats and integers; a mean likewise.
Max and min carry ``[t, -t]`` (a max alone would pass on the rank holding the largest tag).
(Plain powers of two would not do: on 4 ranks 1 + 1 + 2 + 4 = 4 * 2 passes the check of the
rank that sent 2: the property test in ``tests/test_tag.py`` found it.) Product all_reduces
are not tagged (exponents add: no such argument).

What the tag costs: one element per tagged all_reduce (two for max/min), the copy into
the tagged buffer where the producer cannot write there itself, and one small kernel for
the check (``benchmarks/NOTES.md`` has the measured figures).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

import fxcoalesce.kernels  # noqa: F401  (registers fxcoalesce::tag_after)
from fxcoalesce.collectives import ALL_REDUCE, describe, group_of, is_collective, op_of
from fxcoalesce.graph_order import reorder
from fxcoalesce.meta import fake_mode_of, tensor_val

from .emit import Emitter

aten = torch.ops.aten
MESSAGE_START = "fxcoalesce: at run time a peer issued another collective"
"""How every check's message starts (``runtime.Guarded`` recognises it)."""
PROGRAM_TAG = 1.0
"""The tag of every all_reduce issued in the program's own order (2**0)."""
MAX_EXPONENT = 60
"""Tags stay at or below 2**60 (a readable message; no overflow in a wide dtype)."""
SLOTS = {"sum": 1, "avg": 1, "max": 2, "min": 2}
"""Tag elements per reduce op; ops not listed are issued untagged (on every rank alike)."""
CHECKED = "fxcoalesce_tag"
"""Node meta key on a tagged all_reduce: its tag."""


class TagMismatchError(RuntimeError):
    """Raised by a tag check: ranks paired different collectives at run time."""


def _max_exponent(dtype: torch.dtype) -> int | None:
    if dtype.is_floating_point:
        if torch.finfo(dtype).bits < 16 or dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return None
        return int(math.log2(torch.finfo(dtype).max))
    if dtype in (torch.int32, torch.int64):
        return torch.iinfo(dtype).bits - 2
    return None


def taggable(node: Node, world: int) -> bool:
    """Does this collective carry a tag: a functional all_reduce of a tagged op and dtype?"""
    val = tensor_val(node.args[0]) if op_of(node) is ALL_REDUCE else None
    return val is not None and taggable_value(str(node.args[1]), val.dtype, world)


def taggable_value(op: str, dtype: torch.dtype, world: int) -> bool:
    """Is an all_reduce of ``op`` over ``dtype`` on ``world`` ranks tagged?"""
    return op in SLOTS and _max_exponent(dtype) is not None and _exponents(dtype, world, op) > 0


def spacing(world: int) -> int:
    """``c``: tag exponents are multiples of it (module docstring)."""
    return math.ceil(math.log2(max(world, 2))) + 1


def _exponents(dtype: torch.dtype, world: int, op: str) -> int:
    """How many rewrite tags (2**c, 2**2c, ... 2**Kc) ``dtype`` reduces exactly on ``world``
    ranks (with room for W times the largest)."""
    top = min(_max_exponent(dtype) or 0, MAX_EXPONENT)
    headroom = math.ceil(math.log2(max(world, 1)))
    return max(0, (top - headroom) // spacing(world))


def rewrite_tag(key: str, digest: str, dtype: torch.dtype, world: int, op: str) -> float:
    """The tag of a rewritten graph's first all_reduce: 2**(c*i), i >= 1, from the graph's
    program key and the digest of the sequence it issues (equal on every rank that runs that
    rewrite, different for another rewrite but for a 1-in-K coincidence)."""
    h = int(hashlib.sha256(f"{key}/{digest}".encode()).hexdigest()[:12], 16)
    return float(2 ** (spacing(world) * (1 + h % _exponents(dtype, world, op))))


def expected(op: str, tag: float, world: int) -> list[float]:
    """What the tag elements reduce to when every rank sent ``tag``."""
    if op == "sum":
        return [world * tag]
    return [tag, -tag] if SLOTS[op] == 2 else [tag]


def _sent(op: str, tag: float) -> list[float]:
    return [tag, -tag] if SLOTS[op] == 2 else [tag]


def checked_firsts(collectives: list[Node]) -> dict[str | None, Node]:
    """The all_reduces that open a rewritten graph's checks, from its collectives in issue
    order: per group, its first all_reduce that carries a tag (by kind, op and dtype),
    unless every collective of the group comes after such a first all_reduce of a group
    holding all its ranks (that check already stops the graph on each of them before it
    issues anything in the group: a TP group inside the world group, or two groups of the
    same ranks)."""
    return _checks(collectives)[0]


def _checks(collectives: list[Node]) -> tuple[dict[str | None, Node], set[str | None]]:
    """:func:`checked_firsts`, and the groups it covers."""
    firsts: dict[str | None, Node] = {}
    covered: set[str | None] = set()
    seen: set[str | None] = set()
    for n in collectives:
        group = group_of(n)
        if group not in seen:
            seen.add(group)
            ranks = group_members(group)
            if ranks is not None and any(
                    ranks <= (group_members(g) or frozenset()) for g in firsts):
                covered.add(group)
        if (group not in covered and group not in firsts and op_of(n) is ALL_REDUCE
                and _taggable_kind(n)):
            firsts[group] = n
    return firsts, covered


def first_tagged(gm: GraphModule) -> dict[str | None, Node]:
    """:func:`checked_firsts` of ``gm``'s collectives."""
    return checked_firsts([n for n in gm.graph.nodes if is_collective(n)])


def pinned(scan, cfg) -> set:
    """With run-time checks, the comm blocks of the graph's collectives up to and including
    each :func:`checked_firsts` all_reduce, in its group, and every block of a group that
    has none (no tag can guard a rewrite there, say a group of in-place all_reduces: it
    keeps the program's own collectives). They keep their kind, op, dtype and element count
    through every pass (a sum keeps them; a bucket, a slice or a lowering does not), so a
    rewritten graph's first tag in a group pairs with the program's first tag there, behind
    the same collectives (:func:`compatible`). None in a covered group, a group of one
    rank, or where the group is unknown (a hand-built graph): no peer, no tag."""
    if not cfg.run_checks:
        return set()
    blocks = {b.collective: b for b in scan.blocks}
    firsts, covered = _checks(list(scan.sequence))
    out, done = set(), set()
    for n in scan.sequence:
        group = group_of(n)
        if group in covered or group in done or len(group_members(group) or ()) < 2:
            continue
        if n in blocks:
            out.add(blocks[n])
        if n is firsts.get(group):
            done.add(group)
    return out


def group_members(name: str | None) -> frozenset[int] | None:
    """The global ranks of a group: the process group's, else a simulated one's
    (``fxcoalesce.testing.simulated_groups``); None when neither is known."""
    import torch.distributed as dist

    from fxcoalesce.testing import simulated_group_members

    if name is None:
        return None
    try:
        group = dist.distributed_c10d._resolve_process_group(name)
        return frozenset(dist.get_process_group_ranks(group))
    except Exception:  # unknown group names (hand-built graphs)
        ranks = simulated_group_members(name)
        return None if ranks is None else frozenset(ranks)


def _taggable_kind(node: Node) -> bool:
    """:func:`taggable` for any world size (a group of 2 can carry any tag one of 8 can)."""
    return taggable(node, 2)


def _prefix(gm: GraphModule, first: Node) -> list[str]:
    """The collectives of ``first``'s group before it, described without their origin."""
    out = []
    for n in gm.graph.nodes:
        if n is first:
            return out
        if is_collective(n) and group_of(n) == group_of(first):
            out.append(describe(n).split(" <- ")[0])
    return out


def compatible(program: GraphModule, rewritten: GraphModule) -> str | None:
    """Why ``rewritten``'s first all_reduce in some group could not pair, tag for tag, with
    the program's own first all_reduce of that group at that place (None when every group's
    can): another kind, op, dtype or element count, or other collectives of the group before
    it."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    firsts_a, firsts_b = first_tagged(program), first_tagged(rewritten)
    for group in sorted(firsts_a.keys() | firsts_b.keys(), key=str):
        a, b = firsts_a.get(group), firsts_b.get(group)
        if a is None or b is None:
            return f"no tagged all_reduce in group {group} where the program has one"
        if _prefix(program, a) != _prefix(rewritten, b):
            return f"other collectives of group {group} before its first tagged all_reduce"
        va, vb = tensor_val(a.args[0]), tensor_val(b.args[0])
        if (str(a.args[1]), va.dtype) != (str(b.args[1]), vb.dtype):
            return f"its first all_reduce in group {group} has another op or dtype"
        if not statically_known_true(va.numel() == vb.numel()):
            return (f"its first all_reduce in group {group} has {vb.numel()} elements where "
                    f"the program's has {va.numel()}")
    return None


def plan(gm: GraphModule, *, rewritten: bool, world: Callable[[Node], int]) -> list[Node]:
    """The all_reduces of ``gm`` that carry a tag: every taggable one in a graph of the
    program's own order; in a rewritten graph, the :func:`checked_firsts` (and the
    collective after each, made to read its check, when that one is a taggable all_reduce:
    on the host, everything after it is issued after the check)."""
    nodes = [n for n in gm.graph.nodes if is_collective(n)]
    if not rewritten:
        return [n for n in nodes if taggable(n, world(n))]
    out = set()
    for first in checked_firsts(nodes).values():
        if taggable(first, world(first)):
            after = nodes[nodes.index(first) + 1:]
            out |= {first, *(n for n in after[:1] if taggable(n, world(n)))}
    return sorted(out, key=nodes.index)


def tag_pass(gm: GraphModule, *, rewritten: bool, world: Callable[[Node], int], key: str = "",
             digest: str = "", where: str = "") -> list[str]:
    """Tag the planned all_reduces of ``gm`` in place; returns one line per tag. ``where``
    names the graph in the error a failed check raises."""
    tagged = plan(gm, rewritten=rewritten, world=world)
    if not tagged:
        return []
    from fxcoalesce.analysis import analyze

    analysis = analyze(gm)
    blocks = {b.collective: b for b in analysis.scan.blocks}
    barriers = set(analysis.barriers)
    mode = fake_mode_of(gm.graph.nodes)
    lines, last = [], None  # the last check and its message: the next tag reads it
    for i, node in enumerate(tagged):
        block = blocks.get(node)
        if block is None:  # not an analysable all_reduce (several waits): left as it is
            continue
        op, ws = str(node.args[1]), world(node)
        dtype = tensor_val(node.args[0]).dtype
        tag = (PROGRAM_TAG if not rewritten
               else rewrite_tag(key, f"{digest}/{i}", dtype, ws, op))
        said = message(where, op, tag)
        ok = _tag_one(gm, block, op, tag, ws, mode,
                      after_check=last if rewritten else None, message=said)
        last = (ok, said)
        lines.append(f"{node.name}: tag {tag:g}, {op}")
    if rewritten:  # each tagged collective now reads the check before it: issued after it
        reorder(gm.graph, barriers=barriers)  # side effects keep their place
    gm.graph.lint()
    gm.recompile()
    return lines


def message(where: str, op: str, tag: float) -> str:
    """The check's error: short (CUDA's device assert takes under 255 characters) and plain
    (it is embedded in generated C++ as a string literal: no quotes or backslashes); the
    wrapper (``runtime.Guarded``) adds what to do where it can."""
    text = (f"{MESSAGE_START} than this rank here ({where[:40]}, tag {tag:.3g}): it runs "
            "another graph (it re-cut or recompiled alone a stretch the ranks agreed to run "
            "rewritten). No wrong value was returned")
    return text[:250]


def _tag_one(gm: GraphModule, block, op: str, tag: float, world: int, mode, *, after_check,
             message: str) -> Node:
    """Tag one all_reduce (``block``): append the tag to (a copy of) its input, check what
    the tag reduced to after its wait, and hand its consumers a view of the rest.
    ``after_check``: (a check, its message) that must pass before this collective is issued
    (its tag reads it). Returns this tag's check result. (Sending the tag as a second
    tensor of one coalesced launch instead, which saves the copy, measured no faster on one
    H200: ``benchmarks/NOTES.md``.)"""
    from fxcoalesce.meta import propagate_val

    node, wait = block.collective, block.wait
    x = node.args[0]  # as it is now: an earlier tag may have rewired it
    val = tensor_val(x)

    def full(emit, values):
        parts = [emit(aten.full.default, [1], v, dtype=val.dtype, device=val.device,
                      pin_memory=False) for v in values]
        return parts[0] if len(parts) == 1 else emit(aten.cat.default, parts)

    emit = Emitter(gm.graph, before=node, mode=mode)
    sent = full(emit, _sent(op, tag))
    if after_check is not None:  # issued only once the previous tag checked out
        check, said = after_check
        if val.device.type == "cuda":  # stream order: the check's assert runs first
            sent = emit(aten.where.self, check, sent,
                        full(emit, [float("nan")] * SLOTS[op]))
        else:  # the host raises before it issues this collective
            sent = emit(torch.ops.fxcoalesce.tag_after.default, check, sent, said)
    numel = val.numel()
    if not isinstance(numel, int):
        numel = emit(aten.sym_numel.default, x)
    buf = emit(aten.cat.default, [emit(aten.reshape.default, x, [-1]), sent])
    node.replace_input_with(x, buf)
    propagate_val(node, mode)
    propagate_val(wait, mode)
    users = list(wait.users)
    emit = Emitter(gm.graph, after=wait, mode=mode)
    tail = emit(aten.slice.Tensor, wait, 0, numel, None)
    ok = emit(aten.eq.Tensor, tail, full(emit, expected(op, tag, world)))
    if SLOTS[op] == 2:  # ops Inductor lowers as they are (no decomposition runs after us)
        ok = emit(aten.logical_and.default, emit(aten.select.int, ok, 0, 0),
                  emit(aten.select.int, ok, 0, 1))
    emit(aten._assert_async.msg, ok, message)
    data = emit(aten.slice.Tensor, wait, 0, 0, numel)
    shape = [s if isinstance(s, int) else emit(aten.sym_size.int, x, d)
             for d, s in enumerate(val.shape)]
    out = emit(aten.view.default, data, shape)
    for u in users:
        u.replace_input_with(wait, out)
    node.meta[CHECKED] = tag
    return ok
