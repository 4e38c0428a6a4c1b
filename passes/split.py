"""split: split the tokens of each token-parallel stretch in two parts and stagger them, so
that each part's all_reduce runs under the other part's compute (issue 50).

Requires: nothing (each token's row is computed by the same ops on the same weights; a part's
matmul may take another kernel, so results equal plain up to floating-point order:
``Config(reassociate=False)`` turns it off). Ensures: a *stretch* (all_reduces and the ops
around them that treat each token on its own: elementwise ops, matmuls against weights, norms
over the hidden dim; ``token_dims``: DTensor's sharding rules say which) runs once per part;
its inputs are sliced, its outputs concatenated where something outside reads them
(attention, a cache write, any op DTensor has no rule for, a graph output). Parts are
ordered by stage (the split all_reduces on the way): stage s of part a, then of part b, so
a's all_reduce is issued before b's compute and waited after it; the issue order is the
program's, a before b. Under dynamic shapes the parts are ``n // 2`` and ``n - n // 2``.
Chosen by cost per stretch (``cost.part_us``, ``cost.split_exposed_us``), or by
``Config.token_split``.

    before                                  after (part a: rows [0, n//2), part b: the rest)
    %h = mm(%x, %w)                         %ha = mm(slice(%x, 0, 0, n//2), %w)
    %r = wait(all_reduce(%h))               %ra = all_reduce(%ha)           # a on the wire ...
    %y = add(%r, %res)                      %hb = mm(slice(%x, 0, n//2, n), %w)  # ... b computes
    %o = sdpa(view(%y), ...)                %ya = add(wait(%ra), slice(%res, 0, 0, n//2))
                                            %yb = add(wait(all_reduce(%hb)), slice(%res, ...))
                                            %o = sdpa(view(cat([%ya, %yb], 0)), ...)
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_arg

from fxcoalesce.analysis import analyze
from fxcoalesce.checked import pinned_blocks
from fxcoalesce.collectives import CommBlock, group_setup
from fxcoalesce.config import Config, CostModel
from fxcoalesce.cost import (MATMULS, Roofline, compute_prefix, graph_device, node_us,
                             part_us, split_exposed_us)
from fxcoalesce.graph_order import reorder
from fxcoalesce.meta import (ORIGIN, REPLACES, RUN_AFTER, fake_mode_of, hinted_nbytes,
                             origin, propagate_val, replaced, size_hint)

from .decide import MIN_SAVING_SHARE, MIN_SAVING_US
from .result import Bucket, PassResult
from .token_dims import available, keeps, output_vals

aten = torch.ops.aten
PARTS = 2
MIN_TOKENS = 32
"""Fewer tokens never split by cost: parts under 16 tokens run matmuls that read every weight
for a few rows (decode), and the cost model's rooflines are rough there."""
MAX_ASSIGNMENTS = 64
"""Input placements tried per op when a stretch grows backwards (up to its inputs)."""
SHAPE_ARG = {aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
             aten.expand.default: 1, aten.new_empty.default: 1, aten.new_zeros.default: 1,
             aten.new_ones.default: 1, aten.new_full.default: 1}
"""Ops whose argument at this place is their output's shape: a part's copy gets its size."""
VIEWS = {aten.view.default, aten._unsafe_view.default}
"""Replayed on a part as ``reshape``."""


@dataclass(slots=True)
class Stretch:
    """One connected token-parallel region: its nodes in graph order and its all_reduces."""

    nodes: list[Node]
    blocks: list[CommBlock]
    tokens: int | torch.SymInt


@dataclass(slots=True)
class Labels:
    """What the growth found: each node's output token dims and how it reads its inputs."""

    dims: dict[Node, tuple[int, ...]] = field(default_factory=dict)
    takes: dict[Node, dict[Node, int | None]] = field(default_factory=dict)
    """Per split node: each tensor input's token dim, None for an input read whole."""


def _same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - sizes of unrelated shape envs
        return False


def token_dim(block: CommBlock) -> int | None:
    """The dim an all_reduce's tokens lie along: the outermost non-singleton dim before the
    hidden one (a flattened [B*S, D] keeps it outermost: a split of B, or of S when B is 1)."""
    shape = block.shape
    return next((d for d in range(len(shape) - 1) if size_hint(shape[d]) > 1), None)


def find_seeds(gm: GraphModule, pinned=frozenset()):
    """(token count, its all_reduces with their token dims, the other counts' all_reduces):
    one count per graph, the one most all_reduces have (then the largest); pinned, lowered
    and in-place all_reduces are none."""
    analysis = analyze(gm)
    keep = pinned_blocks(analysis.scan, pinned)
    counts = []  # [(token count, [(block, dim)])]: SymInts do not hash
    for b in analysis.scan.blocks:
        d = token_dim(b)
        if b.impl != "nccl" or b.inplace or b in keep or d is None:
            continue
        group = next((g for k, g in counts if _same(k, b.shape[d])), None)
        if group is None:
            counts.append((b.shape[d], group := []))
        group.append((b, d))
    if not counts:
        return None, [], []
    tokens, seeds = max(counts, key=lambda c: (len(c[1]), size_hint(c[0])))
    return tokens, seeds, [(k, g) for k, g in counts if g is not seeds]


def find_stretches(gm: GraphModule, pinned=frozenset()) -> tuple[list[Stretch], Labels]:
    """The stretches of ``gm`` around the all_reduces of :func:`find_seeds`."""
    tokens, seeds, _ = find_seeds(gm, pinned)
    if not seeds:
        return [], Labels()
    labels = _grow(seeds, tokens)
    return _components(seeds, labels, tokens, analyze(gm).order), labels


def _grow(seeds: list[tuple[CommBlock, int]], tokens) -> Labels:
    """Label the nodes around ``seeds`` that keep the split, forwards (users) and backwards
    (producers), until attention, mutations and unknown ops stop it."""
    lab = Labels()
    whole: set[Node] = set()  # read whole by a split node: stays whole
    need: dict[Node, set[int]] = {}  # read split on these dims by split nodes
    tried: set = set()
    todo: deque = deque()

    def accept(u: Node, out: tuple[int, ...], take: dict[Node, int | None]) -> None:
        lab.dims[u], lab.takes[u] = out, take
        for a, d in take.items():
            if a in lab.dims:
                continue
            if d is None:
                whole.add(a)
            else:
                need.setdefault(a, set()).add(d)
                todo.append(("back", a))
        todo.extend(("fwd", user) for user in u.users)

    for b, d in seeds:
        accept(b.collective, (d,), {b.input: d})
        accept(b.wait, (d,), {b.collective: d})
    while todo:
        kind, u = todo.popleft()
        if u in lab.dims or u in whole or (kind, u) in tried or u.op != "call_function":
            continue
        tried.add((kind, u))
        found = (_forward(u, lab, tokens) if kind == "fwd"
                 else _backward(u, need[u], lab, whole, tokens))
        if found is not None:
            accept(u, *found)
    return lab


def _is_tokens(val, dim: int, tokens) -> bool:
    return isinstance(val, torch.Tensor) and 0 <= dim < val.dim() and _same(val.shape[dim],
                                                                           tokens)


def _forward(u: Node, lab: Labels, tokens):
    """(out dims, takes) when ``u`` keeps the split of its split inputs, else None."""
    if u.target is operator.getitem:
        src, i = u.args
        return ((lab.dims[src][i],), {}) if src in lab.dims else None
    dims = {a: lab.dims[a][0] for a in u.all_input_nodes if a in lab.dims}
    if any(len(lab.dims[a]) != 1 for a in dims):
        return None
    kept = keeps(u, dims)
    if kept is None or not _outputs_ok(u, kept.out, tokens):
        return None
    if not all(_is_tokens(a.meta.get("val"), d, tokens) for a, d in kept.wants.items()):
        return None
    take = {a: None for a in u.all_input_nodes if output_vals(a)}
    return kept.out, {**take, **dims, **kept.wants}


def _backward(p: Node, dims_needed: set[int], lab: Labels, whole: set[Node], tokens):
    """(out dims, takes) when ``p`` can compute its output split on the one dim its split
    users read it on, from inputs split or whole, else None."""
    if len(dims_needed) != 1 or p.target is operator.getitem or len(output_vals(p)) != 1:
        return None
    (want,) = dims_needed
    inputs = [a for a in dict.fromkeys(p.all_input_nodes) if output_vals(a)]
    options = []
    for a in inputs:
        val = a.meta["val"]
        if a in lab.dims:
            options.append([lab.dims[a][0]] if len(lab.dims[a]) == 1 else [None])
        elif a in whole or not isinstance(val, torch.Tensor):
            options.append([None])
        else:
            options.append([d for d in range(val.dim()) if _is_tokens(val, d, tokens)] + [None])
    tried = sorted(itertools.product(*options), key=lambda c: sum(d is None for d in c))
    for choice in tried[:MAX_ASSIGNMENTS]:
        if any(a in lab.dims and d is None for a, d in zip(inputs, choice)):
            continue
        dims = {a: d for a, d in zip(inputs, choice) if d is not None}
        if not dims:
            continue
        kept = keeps(p, dims)
        if kept is not None and kept.out == (want,) and not kept.wants:
            return kept.out, {a: d for a, d in zip(inputs, choice)}
    return None


def _outputs_ok(u: Node, out: tuple[int, ...], tokens) -> bool:
    vals = output_vals(u)
    if len(vals) != len(out) or not all(_is_tokens(v, d, tokens) for v, d in zip(vals, out)):
        return False
    # several outputs are read through getitem only (a tuple has no concatenation)
    return len(out) == 1 or all(user.target is operator.getitem for user in u.users)


def _components(seeds, lab: Labels, tokens, order: dict[Node, int]) -> list[Stretch]:
    parent = {u: u for u in lab.dims}

    def find(u):
        while parent[u] is not u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for u in lab.dims:
        for a in (*lab.takes[u], *u.all_input_nodes):
            if a in lab.dims:
                parent[find(a)] = find(u)
    groups: dict[Node, list[Node]] = {}
    for u in sorted(lab.dims, key=order.__getitem__):
        groups.setdefault(find(u), []).append(u)
    return [Stretch(nodes, [b for b, _ in seeds if find(b.collective) is root], tokens)
            for root, nodes in groups.items()]


def split_pass(gm: GraphModule, *, cfg: Config, pinned: frozenset = frozenset()) -> PassResult:
    result = PassResult()
    if cfg.token_split is False or not cfg.reassociate:
        return result
    if (why := available()) is not None:
        result.warnings.append(why)
        return result
    tokens, seeds, others = find_seeds(gm, pinned)
    for k, group in others:
        result.decisions.append(_whole(group, f"{size_hint(k)} tokens: left whole (this graph "
                                                f"splits {size_hint(tokens)})"))
    if not seeds:
        return result
    n = size_hint(tokens)
    if cfg.token_split is None and n < MIN_TOKENS:  # decode: not worth reading the graph for
        result.decisions.append(_whole(seeds, f"{n} tokens: under {MIN_TOKENS}, never split "
                                              "by cost (each part would read every weight "
                                              "for a few rows)"))
        return result
    if cfg.token_split is None and cfg.cost == CostModel():
        result.decisions.append(_whole(seeds, f"{n} tokens: the default cost model is not "
                                              "calibrated, and a split it misprices is slower "
                                              "than none: never split by it (a profile from "
                                              "`fxcoalesce calibrate`, or token_split=True)"))
        return result
    lab = _grow(seeds, tokens)
    chosen = []
    for stretch in _components(seeds, lab, tokens, analyze(gm).order):
        split, record = decide(gm, stretch, lab, cfg)
        result.decisions.append(record)
        if split:
            chosen.append(stretch)
    if chosen:
        result.buckets = rewrite(gm, chosen, lab)
        result.changed = True
    return result


def _whole(seeds, note: str) -> dict:
    n = size_hint(seeds[0][0].shape[seeds[0][1]])
    return {"members": [b.collective.name for b, _ in seeds], "chose": "whole", "note": note,
            "tokens": n, "local": True}


def _halves(tokens) -> tuple[float, float]:
    n = size_hint(tokens)
    return (n // 2) / n, (n - n // 2) / n


def _stages(order, split_waits: set[Node]) -> dict[Node, int]:
    """Per node: the split all_reduces on its longest input path (its wait starts a stage)."""
    stage: dict[Node, int] = {}
    for n in order:
        s = max((stage[a] for a in n.all_input_nodes), default=0)
        stage[n] = s + (n in split_waits)
    return stage


def price(gm: GraphModule, stretch: Stretch, lab: Labels, cfg: Config) -> dict[str, float]:
    """Predicted µs of one stretch split in two: ``gain`` (communication hidden), ``extra``
    (the parts' compute over the whole's: weights read twice, launches; the concatenations),
    ``weights`` (the weights' second read alone) and ``saving`` = gain - extra."""
    analysis = analyze(gm)
    roof = Roofline.of(cfg.cost, graph_device(analysis))
    world = group_setup(analysis.scan)[0] or 2
    shares = _halves(stretch.tokens)
    inside = set(stretch.nodes)
    stage = _stages(analysis.order, {b.wait for b in stretch.blocks})
    compute: dict[tuple[int, int], float] = {}
    extra = weights = 0.0
    for u in stretch.nodes:
        whole = {a for a, d in lab.takes[u].items() if d is None}
        parts = [part_us(u, roof, s, whole) for s in shares]
        for p, us in enumerate(parts):
            compute[stage[u], p] = compute.get((stage[u], p), 0.0) + us
        extra += sum(parts) - node_us(u, roof)
        if any(parts):
            weights += sum(hinted_nbytes(a.meta["val"]) for a in whole) / (roof.memory_gbps * 1e3)
        if any(user not in inside for user in u.users) and len(lab.dims[u]) == 1:
            extra += 2 * hinted_nbytes(u.meta["val"]) / (roof.memory_gbps * 1e3)  # the cat
    prefix = compute_prefix(analysis, roof)
    infos = {i.block.collective: i for i in analysis.infos}
    gain = 0.0
    for b in stretch.blocks:
        t = cfg.cost.all_reduce_us(b.nbytes, world)
        i = infos[b.collective]
        window = prefix[i.need] - prefix[i.ready + 1] if i.need > i.ready + 1 else 0.0
        s = stage[b.collective]
        after = split_exposed_us(cfg.cost, world, b.nbytes, shares,
                                 (compute.get((s, 1), 0.0), compute.get((s + 1, 0), 0.0)))
        gain += t - cfg.cost.hidden_us(t, window, b.nbytes) - after
    return {"gain": gain, "extra": extra, "weights": weights, "saving": gain - extra}


def decide(gm: GraphModule, stretch: Stretch, lab: Labels, cfg: Config) -> tuple[bool, dict]:
    """(split this stretch?, a record for the report, whose ``note`` says why)."""
    n = size_hint(stretch.tokens)
    us = price(gm, stretch, lab, cfg)
    ms = lambda v: f"{v / 1e3:+.3f} ms"  # noqa: E731
    count = len(stretch.blocks)
    forced = cfg.token_split is True
    margin = max(MIN_SAVING_US, MIN_SAVING_SHARE * us["gain"])
    if n < PARTS:
        split, note = False, f"{n} token(s): nothing to split"
    elif forced:
        split, note = True, (f"split in 2 (Config.token_split=True): {n} tokens, {count} "
                             f"all_reduce(s), predicted {ms(-us['saving'])} a step")
    elif us["saving"] > margin:
        split, note = True, (f"split in 2: {n} tokens, {count} all_reduce(s), predicted "
                             f"{ms(-us['saving'])} a step")
    elif us["extra"] >= us["gain"]:
        split, note = False, (f"{n} tokens: the split reads the weights twice "
                              f"({ms(us['weights'])}) and launches its kernels twice: "
                              f"{ms(us['extra'] - us['gain'])} a step")
    else:
        split, note = False, (f"{n} tokens: predicted {ms(-us['saving'])} a step, under the "
                              f"margin ({margin:.1f} µs)")
    return split, {"members": [b.collective.name for b in stretch.blocks],
                   "chose": "split in 2" if split else "whole", "note": note, "tokens": n,
                   "predicted_us": {k: round(v, 2) for k, v in us.items()}, "local": True}


class _Parts:
    """The part bounds: ints, or nodes computing ``n // 2`` from a symbolic count."""

    def __init__(self, graph: Graph, tokens):
        self.graph, self.tokens = graph, tokens
        self.sizes: list | None = None
        self.starts: list | None = None

    def ensure(self, sliced: tuple[Node, int] | None, before: Node) -> None:
        """Make the bounds (before ``before``), from ``sliced``: a (node, dim) whose dim is
        the token count."""
        if self.sizes is not None:
            return
        if isinstance(self.tokens, int):
            a = self.tokens // 2
            self.sizes, self.starts = [a, self.tokens - a], [(0, a), (a, self.tokens)]
            return
        if sliced is None:
            raise RuntimeError(f"split: {before.name} reads no input split on the tokens")
        with self.graph.inserting_before(before):
            n = self.graph.call_function(aten.sym_size.int, sliced)
            propagate_val(n)
            a = self.graph.call_function(operator.floordiv, (n, 2))
            propagate_val(a)
            b = self.graph.call_function(operator.sub, (n, a))
            propagate_val(b)
        self.sizes, self.starts = [a, b], [(0, a), (a, n)]


def rewrite(gm: GraphModule, stretches: list[Stretch], lab: Labels) -> list[Bucket]:
    """Copy each stretch node once per part, slice its inputs, concatenate what leaves it,
    then order the copies by stage and part (``graph_order.reorder``)."""
    graph = gm.graph
    order = list(graph.nodes)
    mode = fake_mode_of(order)
    split = {u for s in stretches for u in s.nodes}
    seeds = {b.collective: b for s in stretches for b in s.blocks}
    bounds = _Parts(graph, stretches[0].tokens)
    parts: dict[Node, list[Node]] = {}
    cats: dict[Node, Node] = {}
    slices: dict[tuple[Node, int], list[Node]] = {}
    part_of: dict[Node, int] = {}
    buckets = []

    def sliced(a: Node, d: int, p: int, before: Node) -> Node:
        if (a, d) not in slices:
            with graph.inserting_before(before):
                slices[a, d] = [graph.call_function(aten.slice.Tensor, (a, d, lo, hi))
                                for lo, hi in bounds.starts]
            for s in slices[a, d]:
                propagate_val(s, mode)
        return slices[a, d][p]

    for u in order:
        if u not in split:
            continue
        take = lab.takes[u]
        # the first split node reads some input sliced (inputs all whole give a whole output)
        bounds.ensure(next(((a, d) for a, d in take.items() if d is not None and a not in split),
                           None), before=u)
        parts[u] = []
        for p in range(PARTS):
            def arg(a: Node, p=p) -> Node:
                if a in split:
                    return parts[a][p] if take.get(a, lab.dims[a][0]) is not None else cats[a]
                d = take.get(a)
                return a if d is None else sliced(a, d, p, u)

            args, kwargs = map_arg((u.args, u.kwargs), arg)
            if u.target in SHAPE_ARG:
                args = _resized(args, SHAPE_ARG[u.target], lab.dims[u][0], bounds.sizes[p])
            # a part of a strided tensor may not be viewable where the whole was
            target = aten.reshape.default if u.target in VIEWS else u.target
            with graph.inserting_before(u):
                new = graph.call_function(target, args, kwargs)
            new.meta.update({k: v for k, v in u.meta.items()
                             if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
            propagate_val(new, mode)
            _check_shape(u, new, lab.dims[u], bounds.sizes[p])
            if u in seeds:
                new.meta[ORIGIN] = f"tokens{p + 1}/{PARTS}({origin(u)})"
                new.meta[REPLACES] = replaced([u])
                b = seeds[u]
                buckets.append(Bucket(members=[u.name], nbytes=hinted_nbytes(new.meta["val"]),
                                      level=0, key=str(b.key), collective=new.name,
                                      kind="split"))
            parts[u].append(new)
            part_of[new] = p
        outside = [user for user in u.users if user not in split
                   or lab.takes[user].get(u, 0) is None]
        if outside and len(lab.dims[u]) == 1:
            with graph.inserting_before(u):
                cats[u] = graph.call_function(aten.cat.default, (parts[u], lab.dims[u][0]))
            propagate_val(cats[u], mode)
            u.replace_all_uses_with(cats[u], delete_user_cb=lambda user: user not in split)
    for u in reversed(order):
        if u in split:
            graph.erase_node(u)
    waits = {w for b in seeds.values() for w in parts[b.wait]}
    stage = _stagger(gm, part_of, waits)
    _mark_order(gm, [parts[b.collective] for b in seeds.values()], stage, part_of)
    return buckets


def _resized(args: tuple, i: int, dim: int, size) -> tuple:
    shape = list(args[i])
    if dim < len(shape) and not (isinstance(shape[dim], int) and shape[dim] == -1):
        shape[dim] = size
    return (*args[:i], shape, *args[i + 1:])


def _check_shape(u: Node, new: Node, dims: tuple[int, ...], size) -> None:
    want = size.meta["val"] if isinstance(size, Node) else size
    for old, got, d in zip(output_vals(u), output_vals(new), dims, strict=True):
        expect = [want if j == d else s for j, s in enumerate(old.shape)]
        if len(got.shape) != len(expect) or not all(map(_same, got.shape, expect)):
            raise RuntimeError(f"split: {new.name} has shape {tuple(got.shape)}, expected "
                               f"{tuple(expect)} (a size argument the pass does not know)")


def _stagger(gm: GraphModule, part_of: dict[Node, int], split_waits: set[Node]
             ) -> dict[Node, int]:
    """Order: by stage, then part (a before b; nodes of no part first), then place. The
    collectives keep their current order (a before b, stage by stage: the program's).
    Returns each node's stage."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    stage = _stages(nodes, split_waits)
    pos = {n: i for i, n in enumerate(nodes)}
    ranked = sorted(nodes, key=lambda n: (stage[n], part_of.get(n, -1), pos[n]))
    priority = {n: float(i) for i, n in enumerate(ranked)}
    reorder(gm.graph, priority, set(analyze(gm).barriers))
    return stage


def _mark_order(gm: GraphModule, pairs: list[list[Node]], stage: dict[Node, int],
                part_of: dict[Node, int]) -> None:
    """Mark what must run before what (``meta.RUN_AFTER``, pinned for Inductor by
    ``graph_order.pin_order``): part a's stage-s all_reduce is hidden by part b's compute of
    stage s, part b's by part a's compute of stage s + 1 (the nodes of it that do not
    themselves wait for b: attention reads both parts). The window's first matmul runs after
    the issue, the wait after the window's last node."""
    nodes = list(gm.graph.nodes)
    of: dict[tuple[int, int], list[Node]] = {}
    for n in nodes:
        if n in part_of and output_vals(n):
            of.setdefault((stage[n], part_of[n]), []).append(n)
    issued = {(stage[ar], part_of[ar]): ar.args[0] for pair in pairs for ar in pair}
    for a, b in pairs:
        s = stage[a]
        for ar, key in ((a, (s, 1)), (b, (s + 1, 0))):
            wait = next(iter(ar.users))
            after, before = _descendants(wait), _ancestors(ar)
            window = [n for n in of.get(key, ()) if n not in after and n not in before]
            if not window:
                continue
            last = issued[key] if issued.get(key) in window else window[-1]
            wait.meta[RUN_AFTER] = (last.name,)
            first = next((n for n in window if n.target in MATMULS), None)
            if first is not None and first is not last:
                first.meta[RUN_AFTER] = (ar.name,)


def _descendants(node: Node) -> set[Node]:
    seen, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _ancestors(node: Node) -> set[Node]:
    seen, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen
