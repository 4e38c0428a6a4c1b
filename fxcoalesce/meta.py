"""Facts about FX nodes' values: fake ``meta["val"]``, storage identity, element counts."""

from __future__ import annotations

import copy
import math
import numbers
import os
import re
from collections import deque

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Node
from torch.fx.immutable_collections import immutable_dict
from torch.fx.node import map_arg
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map


REPLACES = "fxcoalesce_replaces"
"""Node meta key: on a collective a pass made, the names of the original collectives it
stands for (in the graph the pipeline was given)."""


SLICED = "fxcoalesce_sliced"
"""Node meta key: on a collective the slice pass made, the slice it reduces (e.g.
``select(1, -1)``); part of the collective's description, so ranks compare it."""


ORIGIN = "fxcoalesce_origin"
"""Node meta key: on a collective of a graph the pipeline rewrote, what it carries in terms of
the program's own collectives, named by their place in the program's issue sequence: "#3"
(the program's collective #3 itself), "cat(#3,#5)" (a bucket), "sum(#1,0.5*#2)" (a sum of
reductions), "select(1, -1)(#3)" (a slice). Part of the collective's description, so ranks
compare what each collective carries, not only its shape: two buckets of one size can hold
different members on different ranks."""


RUN_AFTER = "fxcoalesce_run_after"
"""Node meta key: on a node of an order a pass staggered (``split``), the names of the nodes
that must run before it (names survive graph copies): a wait after the compute that hides
its collective, that compute after the collective's issue; so that Inductor neither issues
late, waits early, nor fuses the hiding compute with compute after the wait
(``graph_order.pin_order``)."""


def origin(node: Node) -> str:
    return node.meta.get(ORIGIN, "?")


def replaced(collectives) -> list[str]:
    """What a new collective replaces: the originals behind each of ``collectives``."""
    return [name for n in collectives for name in n.meta.get(REPLACES, [n.name])]


INPUT_CHAIN_LIMIT = 32
"""Nodes :func:`module_path` reads up a collective's inputs before it gives up."""


def module_path(node: Node) -> str:
    """The dotted path of the innermost user module that computed ``node``, below the compiled
    root ("L['self'].blocks.0.attn" -> "blocks.0.attn"), from ``meta["nn_module_stack"]``
    (dynamo keeps it on ATen nodes); "" when no module is known. A node without a stack of
    its own (a collective made outside any module) takes the one of the nearest node up its
    input chain."""
    seen, todo = {node}, deque([node])
    while todo and len(seen) <= INPUT_CHAIN_LIMIT:
        n = todo.popleft()
        stack = n.meta.get("nn_module_stack") or {}
        if stack:
            return _dotted(str(list(stack.values())[-1][0]))
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return ""


def _dotted(path: str) -> str:
    """A module path as dynamo writes it ("L['self']._modules['blocks']._modules['0'].attn",
    "getattr(L['self'].blocks, '0')", "L__self___blocks_0") without dynamo's root."""
    path = re.sub(r"^[LG]__\w+?__(?:_|$)", "", path)  # L__self___blocks_0 -> blocks_0
    tokens = [t for t in re.findall(r"[A-Za-z_]\w*|\d+", path)
              if t not in ("_modules", "getattr")]
    if tokens[:1] in (["L"], ["G"]):  # dynamo's name for the root: L['self'], G['model']
        tokens = tokens[2:]
    return ".".join(tokens)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')


def is_torch_file(path: str) -> bool:
    """Is ``path`` a file of PyTorch itself (this installation's, or any ``site-packages``)?"""
    return path.startswith(_TORCH_DIR) or "/site-packages/torch/" in path.replace(os.sep, "/")


def user_frame(stack_trace: str | None) -> tuple[str, str, str, str] | None:
    """(file, line, function, code) of the innermost frame of ``stack_trace`` (a node's
    ``meta["stack_trace"]``) outside PyTorch: the user's line that made the node, where the
    innermost frame is often torch's own (``_functional_collectives.py``). None without one."""
    lines = (stack_trace or "").rstrip().split("\n")
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m and not is_torch_file(m.group(1)):
            after = lines[i + 1] if i + 1 < len(lines) else ""
            code = "" if _FRAME.match(after) else after.strip()
            return m.group(1), m.group(2), m.group(3), code
    return None


UNHINTED_SIZE = 4096
"""Stand-in for a data-dependent size with no hint (size estimates only)."""


def is_scalar(x) -> bool:
    """A Python number argument (a bool is not one: it selects, it does not scale)."""
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def tensor_vals(node: object) -> list[torch.Tensor]:
    """The node's fake tensor values: its ``meta["val"]`` (``example_value`` in Dynamo-level
    graphs), the tensors of it for an op that returns several; [] when it holds none."""
    if not isinstance(node, Node):
        return []
    val = node.meta.get("val", node.meta.get("example_value"))
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def tensor_val(node: object) -> torch.Tensor | None:
    """The node's fake tensor value when it is one tensor, else None."""
    if not isinstance(node, Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value"))
    return val if isinstance(val, torch.Tensor) else None


def storage_of(node: Node) -> StorageWeakRef | None:
    """Identity of the storage the node's value lives in (views share their base's)."""
    val = tensor_val(node)
    return StorageWeakRef(val.untyped_storage()) if val is not None else None


def numel(shape) -> int | torch.SymInt:
    """Product of ``shape`` (ints or SymInts)."""
    return math.prod(shape, start=1)


def same_shape(a, b) -> bool:
    """Are shapes ``a`` and ``b`` equal for every value of their symbols? (False when unsure;
    adds no guard.)"""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def size_hint(s: int | torch.SymInt) -> int:
    """A concrete value for a size: itself, its hint, or ``UNHINTED_SIZE`` when data-dependent."""
    if isinstance(s, int):
        return s
    hint = getattr(s.node, "hint", None)
    return int(hint) if hint is not None else UNHINTED_SIZE


def hinted_numel(shape) -> int:
    """Element count of ``shape`` with size hints for symbolic sizes."""
    return math.prod((size_hint(s) for s in shape), start=1)


def hinted_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` with size hints for symbolic sizes."""
    return hinted_numel(t.shape) * t.element_size()


def propagate_val(node: Node, mode: FakeTensorMode | None = None) -> None:
    """Compute ``node.meta["val"]`` by running its target on its inputs' fake values."""
    args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a,
                            (node.args, node.kwargs))
    mode = mode or detect_fake_mode(args) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def fake_mode_of(nodes) -> FakeTensorMode | None:
    """The fake mode of the nodes' values (``detect_fake_mode``: the tracing context's, else
    the active one, else the values'), read from the first fake value: the values of one
    graph share one mode, and checking each of 10k nodes costs more than a pass."""
    first = next((v for n in nodes if isinstance(v := n.meta.get("val"), FakeTensor)), None)
    if first is None:  # no fake value: whatever else ``detect_fake_mode`` finds in them
        vals = [n.meta.get("val") for n in nodes]
        return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    return detect_fake_mode([first])


def fast_graph_copy(src, dst, nodes: dict):
    """``dst.graph_copy(src, nodes)`` for a new ``dst`` (no owning module, so no node hooks),
    each node made as ``Graph.create_node`` makes it but without its scan of the arguments
    for raw SymInts (a pytree walk per node, half the copy's time): the arguments are
    ``src``'s, which passed it when they were made."""
    if dst.owning_module is not None or len(dst.nodes):
        return dst.graph_copy(src, nodes)
    namespace, table = dst._graph_namespace, dst._find_nodes_lookup_table
    copy_of = nodes.__getitem__
    for node in src.nodes:
        if node in nodes:
            continue
        if node.op == "output":
            return map_arg(node.args[0], copy_of)
        args = map_arg(node.args, copy_of) if node.args else ()
        kwargs = map_arg(node.kwargs, copy_of) if node.kwargs else immutable_dict()
        name = namespace.create_name(node.name, None)
        new = Node(dst, name, node.op, node.target, args, kwargs, node.type)
        namespace.associate_name_with_obj(name, new)
        dst._insert(new)
        table.insert(new)
        dst._len += 1
        new.meta = copy.copy(node.meta)
        nodes[node] = new
    return None
