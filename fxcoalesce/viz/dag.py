"""The collective-to-collective dependency DAG of a graph: what ``inspect --format`` draws.

A node is one collective of the graph (all_reduce or any other), in issue order; an edge
``a -> b`` says ``b`` needs ``a``'s result, through any amount of compute, and is kept only
when no other collective lies on the way (transitive reduction). Data dependencies only:
side-effecting barriers, which the analysis also respects, are not drawn.

    x ─ AR1 ─┬─ AR2 ─ AR3      nodes AR1 AR2 AR4 AR3
             └─ AR4            edges AR1→AR2, AR1→AR4, AR2→AR3 (no AR1→AR3: AR2 is on the way)

Each node also says where it came from: the module path of the layer that issued it
(``node.meta["nn_module_stack"]``) and, for a collective a pass made, the original
collectives it replaces (``meta.REPLACES``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch.fx import GraphModule, Node

from fxcoalesce.analysis import analyze
from fxcoalesce.collectives import (OTHER_COLLECTIVES, find_comm_blocks, is_all_reduce, op_name,
                                    op_of)
from fxcoalesce.meta import REPLACES, hinted_nbytes, tensor_vals


@dataclass(frozen=True, slots=True)
class CollectiveNode:
    """One collective of the graph, with what the picture says about it."""

    name: str
    kind: str
    """"all_reduce", "all_gather", ... or the op's name for unknown communication."""
    nbytes: int
    level: int | None
    """The analysis level of an analysed all_reduce (None for anything else)."""
    depth: int
    """Longest chain of collectives of any kind ending here (1 = depends on none)."""
    module: str
    """Innermost module path that issued it ("layers.0.attn"); "" when unknown."""
    layer: str
    """The repeated layer it belongs to ("layers.0"), else its top module; "" when unknown."""
    replaces: tuple[str, ...]
    """Original collectives a pass merged into this one (empty for an original)."""


@dataclass(slots=True)
class CollectiveDag:
    nodes: list[CollectiveNode]
    """In issue order."""
    edges: list[tuple[str, str]]
    """(a, b): b depends on a, with no collective in between."""


def module_path(node: Node) -> str:
    """The innermost ``nn_module_stack`` entry as a dotted path below the compiled root
    ("L['self'].layers.0.attn" -> "layers.0.attn"), or "" without one."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    tokens = [t for t in re.findall(r"[A-Za-z_]\w*|\d+", str(path)) if t != "_modules"]
    if tokens[:1] in (["L"], ["G"]):  # dynamo's name for the root: L['self'], L['model']
        tokens = tokens[2:]
    return ".".join(tokens)


def layer_of(module: str) -> str:
    """The path up to the first numeric part ("layers.0.attn" -> "layers.0"): one entry of
    a ModuleList of layers. A path without one gives its first part ("embed")."""
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0] if parts else ""


def _kind(node: Node) -> str:
    if is_all_reduce(node):
        return "all_reduce"
    return OTHER_COLLECTIVES.get(op_of(node)) or op_name(node)


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _common_prefix(paths: list[str]) -> str:
    split = [p.split(".") for p in paths if p]
    if not split:
        return ""
    common = []
    for parts in zip(*split):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common) or split[0][0]


def find_collective_dag(gm: GraphModule, *, origins: CollectiveDag | None = None
                        ) -> CollectiveDag:
    """The collective DAG of ``gm``. ``origins`` is the DAG of the graph the pipeline was
    given: a collective a pass made has no module stack of its own and takes its layer
    from the originals it replaces."""
    graph = gm.graph
    scan = find_comm_blocks(graph)
    levels = analyze(graph, scan).levels()
    index = {c: i for i, c in enumerate(scan.sequence)}
    upstream: dict[Node, int] = {}  # bitset of the collectives each node depends on
    ancestors: list[int] = []
    for n in graph.nodes:
        bits = 0
        for i in n.all_input_nodes:
            bits |= upstream[i]
        if n in index:
            ancestors.append(bits)
            bits |= 1 << index[n]
        upstream[n] = bits

    names = [c.name for c in scan.sequence]
    known = {o.name: o for o in origins.nodes} if origins else {}
    nodes, edges, depth = [], [], []
    for i, c in enumerate(scan.sequence):
        covered = 0
        for p in _bits(ancestors[i]):
            covered |= ancestors[p]
        direct = list(_bits(ancestors[i] & ~covered))
        edges += [(names[p], c.name) for p in direct]
        depth.append(1 + max((depth[p] for p in direct), default=0))
        replaces = tuple(c.meta.get(REPLACES, ()))
        module = module_path(c)
        layer = layer_of(module)
        if not module and replaces:
            olds = [known[r] for r in replaces if r in known]
            module = _common_prefix([o.module for o in olds])
            layer = olds[0].layer if olds else ""
        nbytes = sum(map(hinted_nbytes, tensor_vals(c)))
        nodes.append(CollectiveNode(name=c.name, kind=_kind(c), nbytes=nbytes,
                                    level=levels.get(c.name), depth=depth[i], module=module,
                                    layer=layer, replaces=replaces))
    return CollectiveDag(nodes, edges)
