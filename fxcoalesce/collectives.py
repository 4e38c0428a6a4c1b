"""Recognise collectives in an ATen FX graph and group each all_reduce with its wait.

A *comm block* is what a rewrite may move or merge:

    %ar   = _c10d_functional.all_reduce(%x, "sum", "0")     # or all_reduce_ (in place)
    %w    = _c10d_functional.wait_tensor(%ar)
    %c    = aten.copy(%buf, %w)                              # optional: torch.distributed
                                                             # .all_reduce remapped by dynamo

Anything the passes must not touch is reported with a reason instead of raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node
from torch.multiprocessing.reductions import StorageWeakRef

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

ALL_REDUCE = c10d.all_reduce.default
ALL_REDUCE_ = c10d.all_reduce_.default
WAIT = c10d.wait_tensor.default
COPIES = (aten.copy.default, aten.copy_.default)
OTHER_COLLECTIVES = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.all_reduce_coalesced.default: "all_reduce_coalesced",
    c10d.all_reduce_coalesced_.default: "all_reduce_coalesced",
}
COMM_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
              "all_to_all", "alltoall", "broadcast")


@dataclass(frozen=True, slots=True)
class Key:
    """What must match for two all_reduces to share one launch."""

    group: str
    op: str
    dtype: torch.dtype
    device: str

    def __str__(self) -> str:
        return f"{self.op}/{str(self.dtype).removeprefix('torch.')}/{self.device}/group {self.group}"


@dataclass(frozen=True, slots=True)
class CommBlock:
    """One all_reduce with its single wait (and the copy back, for the in-place API)."""

    collective: Node
    wait: Node
    input: Node
    key: Key
    shape: tuple[int, ...]
    nbytes: int
    inplace: bool
    copy_back: Node | None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(slots=True)
class CommScan:
    """Result of :func:`find_comm_blocks`: plain data for the analysis and the passes."""

    blocks: list[CommBlock] = field(default_factory=list)
    skipped: list[tuple[Node, str]] = field(default_factory=list)
    """all_reduces left alone, with the reason."""
    other: dict[str, int] = field(default_factory=dict)
    """Known collectives that are counted but not rewritten, by kind."""
    unknown: list[tuple[Node, str]] = field(default_factory=list)
    """Opaque nodes that look like communication (custom ops), left alone."""

    @property
    def all_reduce_count(self) -> int:
        return len(self.blocks) + len(self.skipped)


def is_all_reduce(node: Node) -> bool:
    return node.op == "call_function" and node.target in (ALL_REDUCE, ALL_REDUCE_)


def tensor_val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def static_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """The shape as plain ints, or None when any size is symbolic."""
    if not all(isinstance(s, int) for s in t.shape):
        return None
    return tuple(t.shape)


def _arg(node: Node, i: int, name: str):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _storage(node: Node):
    val = tensor_val(node)
    return StorageWeakRef(val.untyped_storage()) if val is not None else None


def _block_or_reason(node: Node, order: dict[Node, int], sharing: dict) -> CommBlock | str:
    inp = _arg(node, 0, "input")
    op, group = _arg(node, 1, "reduce_op"), _arg(node, 2, "group_name")
    if not isinstance(inp, Node):
        return "input is not a graph node"
    if not isinstance(group, str):
        return f"group {group!r} is not a resolved group name"
    users = list(node.users)
    if len(users) != 1 or users[0].target is not WAIT:
        waits = sum(u.target is WAIT for u in users)
        return (f"expected exactly one wait_tensor user inside the graph, found {waits} wait(s) "
                f"and {len(users) - waits} other user(s)")
    val = tensor_val(inp)
    if val is None:
        return "input has no tensor metadata (meta['val'])"
    shape = static_shape(val)
    if shape is None:
        return f"symbolic size {tuple(val.shape)} (no static hint)"
    if isinstance(val, torch.Tensor) and val.is_sparse:
        return "sparse input"
    inplace = node.target is ALL_REDUCE_
    if inplace:
        if inp.op == "placeholder" or val._is_view():
            return "all_reduce_ mutates a graph input or a view; the mutation must stay visible"
        if any(order[u] > order[node] for u in inp.users if u is not node):
            return "all_reduce_ input is read again after the in-place collective"
        if len(sharing.get(_storage(inp), ())) > 1:
            return "all_reduce_ input shares storage with other tensors (views) of the graph"
    wait = users[0]
    copy_back = next((u for u in wait.users if u.target in COPIES and u.args[1] is wait), None)
    numel = 1
    for s in shape:
        numel *= s
    return CommBlock(
        collective=node, wait=wait, input=inp,
        key=Key(group=group, op=str(op), dtype=val.dtype, device=str(val.device)),
        shape=shape, nbytes=numel * val.element_size(), inplace=inplace, copy_back=copy_back,
    )


def _looks_like_comm(node: Node) -> bool:
    name = getattr(node.target, "__name__", None) or str(node.target)
    text = f"{getattr(node.target, 'namespace', '')}::{name}".lower()
    return any(w in text for w in COMM_WORDS) or "c10d" in text


def find_comm_blocks(graph: Graph) -> CommScan:
    """Classify every collective in ``graph`` (in node order, so results are deterministic)."""
    scan = CommScan()
    order = {n: i for i, n in enumerate(graph.nodes)}
    sharing: dict = {}  # storage -> nodes whose value lives in it (for in-place safety)
    if any(n.target is ALL_REDUCE_ for n in graph.nodes):
        for n in graph.nodes:
            if n.target not in (ALL_REDUCE_, WAIT) and (s := _storage(n)) is not None:
                sharing.setdefault(s, []).append(n)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if is_all_reduce(node):
            found = _block_or_reason(node, order, sharing)
            if isinstance(found, CommBlock):
                scan.blocks.append(found)
            else:
                scan.skipped.append((node, found))
        elif node.target in OTHER_COLLECTIVES:
            kind = OTHER_COLLECTIVES[node.target]
            scan.other[kind] = scan.other.get(kind, 0) + 1
        elif node.target is WAIT or node.target in COPIES:
            continue
        elif _looks_like_comm(node):
            scan.unknown.append((node, f"opaque op {node.target} looks like communication; "
                                       "fxcoalesce only rewrites _c10d_functional.all_reduce"))
    return scan
