"""A picture of the collectives before and after the pipeline: boxes, edges, colours, and
its Graphviz DOT text (``fxcoalesce.viz.draw`` renders it to SVG or PNG).

Each panel draws one graph's :class:`~fxcoalesce.viz.dag.CollectiveDag`. A collective a pass
made has a colour of its own, and in the *before* panel the originals it replaces have the
same colour, so a merge reads as "these three became that one". A graph with more
collectives than ``max_boxes`` is collapsed: one box per layer when the nodes carry module
paths, else one box per range of dependency depths.

    digraph fxcoalesce {
      subgraph cluster_before {
        "before/all_reduce_1" [label="all_reduce_1 · level 2\\nlayers.0.attn\\n384 B",
                               fillcolor="#8dd3c7"];
        "before/all_reduce" -> "before/all_reduce_1";
      ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the picture itself needs no torch (the CLI's --help imports it)
    from fxcoalesce.viz.dag import CollectiveDag, CollectiveNode

PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
           "#fccde5", "#bc80bd", "#ccebc5", "#ffed6f", "#d9d9d9")
COLLAPSE = ("auto", "none", "layers", "levels")
MAX_BOXES = 40


@dataclass(frozen=True, slots=True)
class Box:
    id: str
    lines: tuple[str, ...]
    colour: str | None
    """Fill colour shared by a new collective and the originals it replaces; None: white."""
    depth: int
    """Row of the box: dependency depth of the collective (of its first member, collapsed)."""


@dataclass(slots=True)
class Panel:
    name: str
    title: str
    boxes: list[Box]
    edges: list[tuple[str, str]]


def size_text(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _counts(nodes: list[CollectiveNode]) -> str:
    kinds: dict[str, int] = {}
    for n in nodes:
        kinds[n.kind] = kinds.get(n.kind, 0) + 1
    return ", ".join(f"{c} {k}" for k, c in kinds.items())


def _colours(after: CollectiveDag) -> dict[str, str]:
    """Colour of each new collective and of each original it replaces, by name."""
    colours = {}
    for i, n in enumerate(n for n in after.nodes if n.replaces):
        colour = PALETTE[i % len(PALETTE)]
        colours[n.name] = colour
        colours.update(dict.fromkeys(n.replaces, colour))
    return colours


def _names(names: tuple[str, ...], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", … ({len(names)})" if len(names) > most else "")


def _box(node: CollectiveNode, colours: dict[str, str]) -> Box:
    head = node.name + (f" · level {node.level}" if node.level is not None else "")
    lines = [head, node.kind if node.kind not in node.name else None, node.module or None,
             size_text(node.nbytes)]
    if node.replaces:
        lines.append(f"replaces {_names(node.replaces)}")
    return Box(node.name, tuple(x for x in lines if x), colours.get(node.name), node.depth)


def _group_key(node: CollectiveNode, mode: str, span: int, deepest: int) -> str:
    if mode == "layers":
        return node.layer or "(top level)"
    lo = (node.depth - 1) // span * span + 1
    hi = min(lo + span - 1, deepest)
    return f"depth {lo}" if hi == lo else f"depths {lo}–{hi}"


def _grouped(dag: CollectiveDag, mode: str, span: int, deepest: int, colours: dict[str, str]
             ) -> tuple[list[Box], list[tuple[str, str]]]:
    groups: dict[str, list[CollectiveNode]] = {}
    for n in dag.nodes:
        groups.setdefault(_group_key(n, mode, span, deepest), []).append(n)
    where = {n.name: key for key, members in groups.items() for n in members}
    boxes = []
    for key, members in groups.items():
        lines = [key, _counts(members), size_text(sum(m.nbytes for m in members))]
        replaced = sum(len(m.replaces) for m in members)
        if replaced:
            lines.append(f"{sum(bool(m.replaces) for m in members)} new, replacing {replaced}")
        colour = next((colours[m.name] for m in members if m.name in colours), None)
        boxes.append(Box(key, tuple(lines), colour, min(m.depth for m in members)))
    edges = list(dict.fromkeys((where[a], where[b]) for a, b in dag.edges
                               if where[a] != where[b]))
    return boxes, edges


def collapse_mode(before: CollectiveDag, collapse: str = "auto", max_boxes: int = MAX_BOXES
                  ) -> str:
    """"none", "layers" or "levels": what ``collapse="auto"`` picks for this graph."""
    if collapse not in COLLAPSE:
        raise ValueError(f"collapse must be one of {', '.join(COLLAPSE)}, not {collapse!r}")
    if collapse != "auto":
        return collapse
    if len(before.nodes) <= max_boxes:
        return "none"
    return "layers" if any(n.layer for n in before.nodes) else "levels"


def collective_picture(before: CollectiveDag, after: CollectiveDag, *, collapse: str = "auto",
                       max_boxes: int = MAX_BOXES, bound: int | None = None) -> list[Panel]:
    """The before and after panels; ``bound`` (the lower bound) goes into the after title."""
    mode = collapse_mode(before, collapse, max_boxes)
    deepest = max((n.depth for n in (*before.nodes, *after.nodes)), default=1)
    span = max(1, math.ceil(deepest / max(max_boxes // 2, 1)))
    colours = _colours(after)
    panels = []
    for name, dag in (("before", before), ("after", after)):
        if mode == "none":
            boxes = [_box(n, colours) for n in dag.nodes]
            edges = list(dag.edges)
        else:
            boxes, edges = _grouped(dag, mode, span, deepest, colours)
        title = f"{name}: {_counts(dag.nodes) or 'no collectives'}"
        if name == "after" and bound is not None:
            title += f" (lower bound {bound})"
        if mode != "none":
            title += f"\none box per {'layer' if mode == 'layers' else 'depth range'}"
        panels.append(Panel(name, title, boxes, edges))
    return panels


def _quote(text: str) -> str:
    """A DOT string: quotes and backslashes escaped, newlines as DOT's centred ``\\n``."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def to_dot(panels: list[Panel], title: str = "") -> str:
    """Graphviz DOT text of ``panels``, one cluster each, side by side."""
    out = ["digraph fxcoalesce {",
           f"  graph [rankdir=TB, fontname=Helvetica, labelloc=t, label={_quote(title)}];",
           "  node [shape=box, style=\"rounded,filled\", fillcolor=white, fontname=Helvetica,"
           " fontsize=10];",
           "  edge [color=\"#555555\"];"]
    for p in panels:
        out += [f"  subgraph cluster_{p.name} {{", f"    label={_quote(p.title)};"]
        for b in p.boxes:
            fill = f", fillcolor={_quote(b.colour)}" if b.colour else ""
            label = _quote("\n".join(b.lines))
            out.append(f"    {_quote(f'{p.name}/{b.id}')} [label={label}{fill}];")
        for a, b in p.edges:
            out.append(f"    {_quote(f'{p.name}/{a}')} -> {_quote(f'{p.name}/{b}')};")
        out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"


def graph_panels(before_gm, after_gm, *, collapse: str = "auto", bound: int | None = None
                 ) -> list[Panel]:
    """The before and after panels of two graph modules' collectives (``after_gm``'s new
    collectives take their module paths from the originals in ``before_gm``)."""
    from fxcoalesce.viz.dag import find_collective_dag

    before = find_collective_dag(before_gm)
    after = find_collective_dag(after_gm, origins=before)
    return collective_picture(before, after, collapse=collapse, bound=bound)


def graph_dot(before_gm, after_gm, *, collapse: str = "auto", title: str = "",
              bound: int | None = None) -> str:
    """DOT text of two graph modules' collectives (what the pipeline's trace artifact holds)."""
    return to_dot(graph_panels(before_gm, after_gm, collapse=collapse, bound=bound), title)
