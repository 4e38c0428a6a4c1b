"""Trace each kind of layer once and compose the whole step's report from them.

A full-size model repeats a few kinds of layer (DeepSeek-V3: 3 dense layers, then 58 MoE
ones; Cohere2: three sliding-window layers, then a global one), and tracing every layer
costs a minute or more. ``inspect`` traces the model with only one layer of each kind, the
first and the last layer apart (the graph's first all_reduce, which carries the run-time
check, and the final norm meet them), and scales each traced layer's share of the report by
the number of layers it stands for:

    plan = plan_layers(model, config)        # None: trace every layer
    with only_picked(plan, config):
        before, after, report = trace_step(...)
    composed = compose(before, after, report, plan, cost=..., tp=8)

A layer's kind is what its forward can depend on: its modules (paths, classes, parameter
shapes, simple attributes such as ``sliding_window``, hooks) and the config's per-layer
lists at its index (``layer_types``, ...). Each collective, node and predicted µs of the
traced graph belongs to the layer whose module made it (``meta.module_path``) or to none
(the embedding, the head); the longest chain grows by each layer's own links. The
composition holds when no merge spans two layers and each layer's chains start after the
previous layer's (sequential residual blocks): :func:`compose` checks both and returns the
reason otherwise, and ``inspect`` then traces every layer.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.fx import GraphModule, Node

from fxcoalesce.meta import _dotted

MIN_LAYERS = 5
"""Fewer layers than this: trace every one (composing would save little)."""
SKIP_ATTRIBUTES = ("layer_idx", "layer_id", "layer_number", "layer_index", "idx")
"""Module attributes that number the layer, not say what it computes."""


@dataclass(slots=True)
class LayerPlan:
    """Which layers of the decoder's list are traced, and how many each stands for."""

    path: str
    """The list's module path ('model.layers')."""
    owner: nn.Module
    attr: str
    layers: nn.ModuleList
    """The model's own list (every layer)."""
    kinds: list[int]
    """Per layer, its kind (an index into the distinct kinds, first and last apart)."""
    picked: list[int]
    """The layers traced, in order."""
    weights: list[int]
    """Per traced layer, how many layers of the model it stands for."""
    per_layer: dict[str, list]
    """The config's per-layer lists (set to the picked layers' entries while tracing)."""

    @property
    def depth(self) -> int:
        return len(self.layers)

    def spans(self) -> list[str]:
        """Per traced layer, the layers it stands for: '0', '1-2', '3-59', '60'."""
        out = []
        for p in self.picked:
            same = [i for i, k in enumerate(self.kinds) if k == self.kinds[p]]
            out.append(_ranges(same))
        return out

    def text(self) -> str:
        """'traced 4 of 61 layers, one of each kind (0; 1-2; 3-59; 60), and composed ...'."""
        kinds = len(self.picked)
        return (f"traced {kinds} of {self.depth} layers, one of each kind ("
                + "; ".join(self.spans()) + "; the first and the last apart), and composed "
                "the step's report from them; --all-layers traces every layer")


def _ranges(indices: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts, start = [], None
    for a, b in zip(indices, indices[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = None
    return ", ".join(parts)


def find_layer_list(model: nn.Module, depth: int | None = None
                    ) -> tuple[str, nn.Module, str, nn.ModuleList] | None:
    """(path, owner, attribute, list) of the model's list of layers: the ModuleList of
    ``depth`` entries (the config's ``num_hidden_layers``), else the longest one; None when
    there is none of at least :data:`MIN_LAYERS`."""
    best = None
    for path, owner in model.named_modules():
        for attr, child in owner.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) < MIN_LAYERS:
                continue
            full = f"{path}.{attr}" if path else attr
            if depth is not None and len(child) == depth:
                return full, owner, attr, child
            if best is None or len(child) > len(best[3]):
                best = (full, owner, attr, child)
    return best if depth is None else None


def _simple(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_simple(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype))


def _hooks(module: nn.Module) -> tuple:
    def name(h):
        fn = getattr(h, "func", h)
        return getattr(fn, "__qualname__", type(fn).__name__)
    return tuple(name(h) for hooks in (module._forward_pre_hooks, module._forward_hooks)
                 for h in hooks.values())


def signature(layer: nn.Module) -> tuple:
    """What a layer's forward depends on, less its number: per submodule its path, class,
    parameter and buffer shapes and dtypes, simple attributes and hooks."""
    out = []
    for path, m in layer.named_modules():
        tensors = tuple((n, tuple(t.shape), str(t.dtype))
                        for n, t in (*m.named_parameters(recurse=False),
                                     *m.named_buffers(recurse=False)) if t is not None)
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in SKIP_ATTRIBUTES
                             and _simple(v)))
        out.append((path, type(m).__qualname__, tensors, attrs, _hooks(m)))
    return tuple(out)


def plan_layers(model: nn.Module | None, config=None) -> LayerPlan | None:
    """The layers to trace: the first, the last, and the first of each kind between; None
    when the model has no list of layers or every layer would be traced anyway."""
    if model is None:
        return None
    text = config.get_text_config() if config is not None else None
    depth = getattr(text, "num_hidden_layers", None)
    found = find_layer_list(model, depth)
    if found is None:
        return None
    path, owner, attr, layers = found
    n = len(layers)
    per_layer = {}
    if text is not None:
        per_layer = {k: v for k, v in vars(text).items()
                     if isinstance(v, list) and len(v) == n and not k.startswith("_")}
    seen: dict[tuple, int] = {}
    kinds = []
    for i, layer in enumerate(layers):
        key = (signature(layer), tuple(repr(v[i]) for v in per_layer.values()))
        key = ("first",) if i == 0 else ("last",) if i == n - 1 else key
        kinds.append(seen.setdefault(key, len(seen)))
    picked = sorted({kinds.index(k) for k in set(kinds)})
    if len(picked) >= n - 1:
        return None
    weights = [kinds.count(kinds[p]) for p in picked]
    return LayerPlan(path, owner, attr, layers, kinds, picked, weights, per_layer)


@contextlib.contextmanager
def only_picked(plan: LayerPlan, config=None):
    """The model with only the picked layers (each keeping its own number), and the
    config's per-layer lists and depth cut to them, while the block runs."""
    text = config.get_text_config() if config is not None else None
    saved = {k: getattr(text, k) for k in (*plan.per_layer, "num_hidden_layers")
             if text is not None and hasattr(text, k)}
    setattr(plan.owner, plan.attr, nn.ModuleList(plan.layers[i] for i in plan.picked))
    try:
        if text is not None:
            for k, v in plan.per_layer.items():
                setattr(text, k, [v[i] for i in plan.picked])
            if "num_hidden_layers" in saved:
                text.num_hidden_layers = len(plan.picked)
        yield
    finally:
        setattr(plan.owner, plan.attr, plan.layers)
        for k, v in saved.items():
            setattr(text, k, v)


# --- composing ---------------------------------------------------------------------------

@dataclass(slots=True)
class Composed:
    """The whole step's report, composed, and what the predictions need."""

    report: object
    """A ``Report`` whose counts, bytes, bound, nodes, buckets and predictions are the whole
    step's; its pipeline times are the traced layers'."""
    predict: Callable
    """``predict(analysis, cost, world)`` for the traced before/after graphs, composed."""
    plan: LayerPlan
    traced: object = None
    """The traced layers' own report (what ``before.txt``, ``after.txt`` and the pictures
    show)."""


class Segments:
    """Which traced layer (its index among the picked; None: no layer) made each node."""

    def __init__(self, plan: LayerPlan):
        from fxcoalesce.meta import module_path

        self.plan = plan
        self._path = module_path
        self._maps: dict = {}
        self._re = re.compile(r"(?:^|\.)" + re.escape(plan.path) + r"\.(\d+)(?:\.|$)")

    def of_path(self, path: str) -> int | None:
        m = self._re.search(path or "")
        return int(m.group(1)) if m else None

    def of(self, node: Node) -> int | None:
        graph = node.graph
        if graph not in self._maps:
            self._maps[graph] = self._map(graph)
        return self._maps[graph].get(node)

    def _map(self, graph) -> dict[Node, int | None]:
        """Each node's traced layer: its own module's (``nn_module_stack``); a node a pass
        made, which has none, the latest layer among its inputs (the residual stream flows
        from layer to layer, so that is the layer it computes for); an input, the layer of
        the nodes that read it, else the input's before it (inputs come in the modules'
        order: a parameter's twin that nothing reads sits beside it)."""
        seg: dict[Node, int | None] = {}
        for n in graph.nodes:
            if n.op in ("placeholder", "get_attr", "output"):
                continue
            stack = n.meta.get("nn_module_stack")
            if stack:  # the innermost entry inside a layer (a function such as HF's
                # apply_rotary_pos_emb can be the innermost, named without the layer)
                seg[n] = next((s for s in (self.of_path(_dotted(str(v[0])))
                                           for v in reversed(list(stack.values())))
                               if s is not None), None)
            else:
                found = [seg[i] for i in n.all_input_nodes if seg.get(i) is not None]
                seg[n] = max(found) if found else None
        last = None
        for n in graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                found = [seg[u] for u in n.users if seg.get(u) is not None]
                seg[n] = min(found) if found else (last if n.op == "placeholder"
                                                   and not n.users else None)
                if n.op == "placeholder":
                    last = seg[n]
        return seg

    def weight(self, seg: int | None) -> int:
        return 1 if seg is None else self.plan.weights[seg]


def _node_count(graph, segs: Segments) -> int:
    """Nodes of ``graph``, each counted once per layer its traced layer stands for."""
    return sum(segs.weight(segs.of(n)) for n in graph.nodes)


def _weighted(items, segs: Segments) -> int:
    return sum(segs.weight(segs.of(n)) for n in items)


def _bound(analysis, segs: Segments) -> tuple[int, dict[str, int], str | None]:
    """The longest chain, composed: per key, each layer adds the links it puts on top of
    the chain before it; (bound, chains per key, why it cannot be composed)."""
    pos = analysis.order  # node -> its place in the graph
    by_key: dict[str, list] = {}
    for info in analysis.infos:
        by_key.setdefault(str(info.block.key), []).append(info)
    chains = {}
    for key, infos in by_key.items():
        seg_of = {id(i): segs.of(i.block.collective) for i in infos}
        start = min((pos.get(i.block.collective, 0) for i in infos
                     if seg_of[id(i)] is not None), default=None)
        levels: dict[object, list[int]] = {}
        for i in infos:
            seg = seg_of[id(i)]
            if seg is None:  # the embedding's before the layers, the head's after them
                seg = "pre" if start is None or pos.get(i.block.collective, 0) < start \
                    else "post"
            levels.setdefault(seg, []).append(i.level)
        top, total = 0, 0
        for seg in ["pre", *range(len(segs.plan.picked)), "post"]:
            if seg not in levels:
                continue
            low, high = min(levels[seg]), max(levels[seg])
            if isinstance(seg, int) and low <= top:
                return 0, {}, (f"an all_reduce of layer {segs.plan.picked[seg]} does not "
                               "depend on the layers before it")
            total += (max(high, top) - top) * (segs.plan.weights[seg]
                                               if isinstance(seg, int) else 1)
            top = max(top, high)
        chains[key] = total
    return sum(chains.values()), chains, None


def _other(scan, segs: Segments) -> dict[str, int]:
    """The other collectives (all_gather, ...) by kind, each counted per layer it stands for."""
    from fxcoalesce.collectives import OTHER_COLLECTIVES, op_name, op_of

    reduces = {b.collective for b in scan.blocks} | {n for n, _ in scan.skipped}
    out: dict[str, int] = {}
    for n in scan.sequence:
        if n not in reduces:
            kind = OTHER_COLLECTIVES.get(op_of(n)) or op_name(n)
            out[kind] = out.get(kind, 0) + segs.weight(segs.of(n))
    return out


def _renamed(record: dict, plan: LayerPlan, seg: int | None, copy: int) -> dict:
    """A bucket of traced layer ``seg`` as it is in the ``copy``-th layer of its kind."""
    if seg is None:
        return record
    real = [i for i, k in enumerate(plan.kinds) if k == plan.kinds[plan.picked[seg]]][copy]
    pattern = re.compile(r"((?:^|\.)" + re.escape(plan.path) + r"\.)" + str(seg) + r"(?=\.|$)")
    return {**record, "modules": [pattern.sub(lambda m: f"{m.group(1)}{real}", p)
                                  for p in record.get("modules", [])],
            "layer": real, "traced_as": plan.picked[seg]}


def predict_composed(segs: Segments) -> Callable:
    """``cost.predict`` of a traced graph with each all_reduce's time counted once per layer
    its traced layer stands for (the same terms, summed with weights, rounded once)."""
    from fxcoalesce.cost import Roofline, compute_prefix, graph_device

    def predict(analysis, cost, world: int) -> dict[str, float]:
        roof = Roofline.of(cost, graph_device(analysis))
        prefix = compute_prefix(analysis, roof)
        total = hidden = 0.0
        for info in analysis.infos:
            w = segs.weight(segs.of(info.block.collective))
            t = cost.all_reduce_us(info.block.nbytes, world)
            total += w * t
            hidden += w * cost.hidden_us(t, prefix[info.need] - prefix[info.ready + 1],
                                         info.block.nbytes)
        return {"total": round(total, 1), "hidden": round(hidden, 1),
                "exposed": round(total - hidden, 1)}

    return predict


def compose(before: GraphModule, after: GraphModule, report, plan: LayerPlan, *, cost,
            ) -> Composed | str:
    """The whole step's report from the traced layers' (``report``, of ``before`` and
    ``after``), or why it cannot be composed (a merge across layers, a layer whose chains
    do not follow the previous layer's)."""
    from fxcoalesce.analysis import analyze
    from fxcoalesce.report import bound_analysis, split_taken, verdict

    segs = Segments(plan)
    for b in report.buckets:
        layers = {segs.of_path(p) for p in b.get("modules", [])}
        if len(layers) > 1:
            return (f"a merge spans traced layers ({' + '.join(b.get('modules', []))})")
    ab, aa = analyze(before), analyze(after)
    bound_of = bound_analysis(ab, aa)
    bound, chains, why = _bound(bound_of, segs)
    if why:
        return why

    def count(analysis):
        scan = analysis.scan
        return _weighted([b.collective for b in scan.blocks]
                         + [n for n, _ in scan.skipped], segs)

    def nbytes(analysis):
        return sum(i.block.nbytes * segs.weight(segs.of(i.block.collective))
                   for i in analysis.infos)

    if not any(segs.of(n) is not None for n in before.graph.nodes):
        return "no node of the traced step is in its list of layers"
    before_n, after_n = count(ab), count(aa)
    def every_copy(records: list[dict]) -> list[dict]:
        """Each record of a traced layer once per layer it stands for, named as there."""
        out = []
        for r in records:
            seg = next((s for s in (segs.of_path(p) for p in r.get("modules", []))
                        if s is not None), None)
            out += [_renamed(r, plan, seg, copy) for copy in range(segs.weight(seg))]
        return out

    left_alone = _weighted([n for n, _ in bound_of.scan.skipped], segs)
    all_reduce = {"before": before_n, "after": after_n, "lower_bound": bound,
                  "left_alone": left_alone, "bytes_before": nbytes(ab),
                  "bytes_after": nbytes(aa)}
    predict = predict_composed(segs)
    world = report.predicted_comm_us.get("world_size_assumed") or 2
    decisions = every_copy(report.decisions)
    split = sum(len(d["members"]) for d in split_taken(decisions))
    text = verdict(ab, aa, report.decisions)
    above = after_n - left_alone - bound - split
    text = re.sub(r"^\d+ launch\(es\) above the bound", f"{above} launch(es) above the bound",
                  text)
    text = re.sub(r"token split adds \d+ launch\(es\) by design \(each of \d+",
                  f"token split adds {split} launch(es) by design (each of {split}", text)
    text = re.sub(r"\d+ all_reduce\(s\) left alone", f"{left_alone} all_reduce(s) left alone",
                  text)
    composed = replace(
        report, all_reduce=all_reduce, chains=chains, buckets=every_copy(report.buckets),
        decisions=decisions,
        nodes={"before": _node_count(before.graph, segs),
               "after": _node_count(after.graph, segs)},
        other_collectives=_other(ab.scan, segs),
        predicted_comm_us={**report.predicted_comm_us,
                           "before": predict(ab, cost, world),
                           "after": predict(aa, cost, world)},
        verdict=text, windows=[])
    return Composed(composed, predict, plan, report)
