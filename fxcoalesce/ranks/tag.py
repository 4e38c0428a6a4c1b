"""The check on the wire: a tag at the end of a rewritten graph's first all_reduce per group.

    before                                   after (tag id i, K = TAG_BITS)
    %ar = all_reduce(%x, "sum", g)           %cat = cat([reshape(%x, [-1]), bits(i)])
    %w  = wait_tensor(%ar)                   %ar  = all_reduce(%cat, "sum", g)
    %y  = add(%w, %r)                        %w   = wait_tensor(%ar)
                                             _assert_async(agree(%w[n:], bits(i)), ...)
                                             %y   = add(view(%w[:n], shape(%x)), %r)

Which all_reduce (``fxcoalesce.checked``): in each group the graph's first, which every pass
leaves as the program has it; the collective after it waits for the check (a one-element
gate, :func:`plan`). The tag: id ``i`` as K bits ``b`` sent as ``[b, 1 - b]``; after a sum
every pair adds to the number of ranks, after a mean, max or min to 1; every rank checks
``tail == [b, 1 - b] * pair sums`` with every pair sum above 0, which holds on one rank exactly
when every rank sent the same bits, for any world size, exact in every tagged dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

import fxcoalesce.kernels  # noqa: F401  (registers fxcoalesce::tag_after)
from fxcoalesce.checked import checked_firsts, taggable
from fxcoalesce.collectives import is_collective
from fxcoalesce.graph_order import reorder
from fxcoalesce.meta import fake_mode_of, tensor_val
from fxcoalesce.pipeline import emitter


aten = torch.ops.aten
MESSAGE_START = "fxcoalesce: at run time a peer issued another collective"
"""How every check's message starts (``hooks.Guarded`` recognises it)."""
TAG_BITS = 16
"""Bits of a tag id: 2 * TAG_BITS elements per tagged all_reduce."""
CHECKED = "fxcoalesce_tag"
"""Node meta key on a tagged all_reduce: its tag id."""


def bits(tag: int) -> list[int]:
    """What a rank sends for tag id ``tag``: its K bits, then their complements."""
    if not 0 < tag < 2 ** TAG_BITS:
        raise ValueError(f"tag id {tag} is not in 1..{2 ** TAG_BITS - 1}")
    b = [(tag >> j) & 1 for j in range(TAG_BITS)]
    return b + [1 - x for x in b]


def agrees(tail: torch.Tensor, tag: int) -> bool:
    """Did every rank send ``tag`` (``tail``: what the tag elements reduced to)?"""
    sent = torch.tensor(bits(tag), dtype=tail.dtype, device=tail.device)
    n = _pair_sums(tail)
    return bool(torch.equal(tail, sent * n) and (n > 0).all())


def _pair_sums(tail: torch.Tensor) -> torch.Tensor:
    half = tail[:TAG_BITS] + tail[TAG_BITS:]
    return torch.cat([half, half])


def plan(gm: GraphModule, *, world: Callable[[Node], int]) -> list[tuple[Node, str]]:
    """The all_reduces of a tagged graph ``gm`` that carry something, in issue order: the
    :func:`checked_firsts` carry the tag (``"tag"``), and the collective after each, when it
    is a taggable all_reduce, one element made from that check (``"gate"``): on the host it
    cannot be issued before the check passed, so a mispairing stops at the first collective,
    before a second (of another size, which gloo aborts on) is on the wire."""
    nodes = [n for n in gm.graph.nodes if is_collective(n)]
    roles: dict[Node, str] = {}
    for first in checked_firsts(nodes).values():
        if taggable(first, world(first)):
            roles[first] = "tag"
            after = nodes[nodes.index(first) + 1:]
            for n in after[:1]:
                if taggable(n, world(n)):
                    roles.setdefault(n, "gate")
    return sorted(roles.items(), key=lambda kv: nodes.index(kv[0]))


def tag_pass(gm: GraphModule, tag: int, *, world: Callable[[Node], int], where: str = ""
             ) -> list[str]:
    """Tag the planned all_reduces of ``gm`` in place with tag id ``tag``; returns one line
    per tagged or gated all_reduce. ``where`` names the graph in the error a failed check
    raises."""
    planned = plan(gm, world=world)
    if not planned:
        return []
    from fxcoalesce.analysis import analyze

    analysis = analyze(gm)
    blocks = {b.collective: b for b in analysis.scan.blocks}
    barriers = set(analysis.barriers)
    mode = fake_mode_of(gm.graph.nodes)
    lines, last, said, checks = [], None, "", 0  # last: the check the next collective reads
    for node, role in planned:
        block = blocks.get(node)
        if block is None:  # not an analysable all_reduce (several waits): left as it is
            continue
        if role == "tag":
            said, checks = message(where, tag, checks), checks + 1
            last = _tag_one(gm, block, tag, mode, after_check=last, message=said)
            lines.append(f"{node.name}: tag {tag}, {node.args[1]}")
        elif last is not None:
            _carry(gm, block, mode,
                   lambda emit, val, check=last, said=said: _gated(emit, val, check, said, 1))
            lines.append(f"{node.name}: issued after the check")
    reorder(gm.graph, barriers=barriers)  # each reads the check before it; side effects
    gm.graph.lint()                      # keep their place
    gm.recompile()
    return lines


def message(where: str, tag: int, check: int = 0) -> str:
    """The check's error: short (CUDA's device assert takes under 255 characters) and plain
    (it is embedded in generated C++ as a string literal: no quotes or backslashes); the
    wrapper (``hooks.Guarded``) adds what to do where it can. ``check``: which of the
    graph's checks (0: its first group's), read back by :func:`failed_check`."""
    text = (f"{MESSAGE_START} than this rank here ({where[:40]}, tag {tag}, check {check}): "
            "it runs "
            "another graph (it re-cut or recompiled alone a stretch the ranks agreed to run "
            "rewritten). No wrong value was returned")
    return text[:250]


def _gated(emit, val, check, said: str, width: int, sent=None):
    """``sent`` (zeros of ``width`` by default), made only once ``check`` holds: on CUDA the
    check's assert runs first in stream order (NaN otherwise), on the host a failed check
    raises before the collective that sends it is issued."""
    if sent is None:
        sent = emit(aten.full.default, [width], 0, dtype=val.dtype, device=val.device,
                    pin_memory=False)
    if val.device.type == "cuda":
        nan = emit(aten.full.default, [width], float("nan"), dtype=val.dtype,
                   device=val.device, pin_memory=False)
        return emit(aten.where.self, check, sent, nan)
    return emit(torch.ops.fxcoalesce.tag_after.default, check, sent, said)


def _carry(gm: GraphModule, block, mode, extra) -> tuple[Node, Node]:
    """Append ``extra(emit, val)`` to (a copy of) ``block``'s all_reduce input and hand its
    consumers a view of the rest; returns (the appended elements sent, what they reduced
    to)."""
    from fxcoalesce.meta import propagate_val

    node, wait = block.collective, block.wait
    x = node.args[0]  # as it is now: an earlier tag may have rewired it
    val = tensor_val(x)
    emit = emitter(gm.graph, before=node, mode=mode)
    sent = extra(emit, val)
    numel = val.numel()
    if not isinstance(numel, int):
        numel = emit(aten.sym_numel.default, x)
    buf = emit(aten.cat.default, [emit(aten.reshape.default, x, [-1]), sent])
    node.replace_input_with(x, buf)
    propagate_val(node, mode)
    propagate_val(wait, mode)
    users = list(wait.users)
    emit = emitter(gm.graph, after=wait, mode=mode)
    tail = emit(aten.slice.Tensor, wait, 0, numel, None)
    data = emit(aten.slice.Tensor, wait, 0, 0, numel)
    shape = [s if isinstance(s, int) else emit(aten.sym_size.int, x, d)
             for d, s in enumerate(val.shape)]
    out = emit(aten.view.default, data, shape)
    for u in users:
        u.replace_input_with(wait, out)
    return sent, tail


def _tag_one(gm: GraphModule, block, tag: int, mode, *, after_check, message: str) -> Node:
    """Tag one all_reduce (``block``) with tag id ``tag`` (:func:`bits`) and check what the
    tag reduced to after its wait. ``after_check``: a check that must pass before this
    collective is issued. Returns this tag's check result. (Sending the tag as a second
    tensor of one coalesced launch instead, which saves the copy, measured no faster on one
    H200: ``benchmarks/NOTES.md``.)"""
    pattern = sum(b << j for j, b in enumerate(bits(tag)))
    width = 2 * TAG_BITS
    made = {}

    def sent_bits(emit, val):
        word = emit(aten.full.default, [width], pattern, dtype=torch.int64,
                    device=val.device, pin_memory=False)
        shift = emit(torch.ops.prims.iota.default, width, start=0, step=1, dtype=torch.int64,
                     device=val.device, requires_grad=False)
        ones = emit(aten.bitwise_and.Scalar, emit(aten.bitwise_right_shift.Tensor, word, shift),
                    1)
        made["bits"] = emit(torch.ops.prims.convert_element_type.default, ones, val.dtype)
        if after_check is None:
            return made["bits"]
        return _gated(emit, val, after_check, message, width, sent=made["bits"])

    _, tail = _carry(gm, block, mode, sent_bits)
    emit = emitter(gm.graph, after=tail, mode=mode)
    half = emit(aten.add.Tensor, emit(aten.slice.Tensor, tail, 0, 0, TAG_BITS),
                emit(aten.slice.Tensor, tail, 0, TAG_BITS, None))
    want = emit(aten.mul.Tensor, made["bits"], emit(aten.cat.default, [half, half]))
    bad = emit(aten.logical_or.default,  # ops Inductor lowers as they are (no
               emit(aten.any.default, emit(aten.ne.Tensor, tail, want)),  # decomposition
               emit(aten.any.default, emit(aten.le.Scalar, half, 0)))  # runs after us)
    ok = emit(aten.logical_not.default, bad)
    emit(aten._assert_async.msg, ok, message)
    block.collective.meta[CHECKED] = tag
    return ok
