"""Recognise collectives in an ATen FX graph and group each all_reduce with its wait.

A *comm block* is what a rewrite may move or merge:

    %ar   = _c10d_functional.all_reduce(%x, "sum", "0")     # or all_reduce_ (in place)
    %w    = _c10d_functional.wait_tensor(%ar)
    %c    = aten.copy(%buf, %w)                              # optional: torch.distributed
                                                             # .all_reduce remapped by dynamo

Every collective, analysed or not, also takes a place in the graph's *issue sequence*: the
order in which a rank launches them. Ranks pair collectives by that order, so every pass
keeps it a function of rank-invariant facts (see ``graph_order.reorder``).

Anything the passes must not touch is reported with a reason instead of raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from .meta import ORIGIN, SLICED, hinted_numel, numel, storage_of, tensor_val, tensor_vals
from .reduce_ops import left_alone, reduce_op_name

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
    c10d.broadcast.default: "broadcast",
    c10d.broadcast_.default: "broadcast",
}
LOWERED = {
    "symm_mem::one_shot_all_reduce": "one_shot",
    "fxcoalesce::one_shot_all_reduce": "one_shot",
    "symm_mem::two_shot_all_reduce_": "two_shot",
    "fxcoalesce::all_reduce_add_rms_norm": "fused_add_rms_norm",
    "fxcoalesce::nccl_symm_all_reduce": "nccl_symm",
}
"""The implementations the ``lower`` and ``fuse_norm`` passes put in an all_reduce's place, by
op name: each is its own wait (it returns the reduced value), on a group named by its
``group_name`` argument."""
COMM_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
              "all_to_all", "alltoall", "broadcast")


@dataclass(frozen=True, slots=True)
class Key:
    """What must match for two all_reduces to share one launch."""

    group: str
    """The group's name, or how an FX-node group is made (:func:`group_identity`)."""
    op: str
    """The reduce op's name ("sum"), whether the graph holds the string or ``dist.ReduceOp``."""
    dtype: torch.dtype
    device: str

    def __str__(self) -> str:
        return f"{self.op}/{str(self.dtype).removeprefix('torch.')}/{self.device}/group {self.group}"


@dataclass(frozen=True, slots=True, eq=False)
class CommBlock:
    """One all_reduce with its single wait (and the copy back, for the in-place API).
    Compared and hashed by identity (its shape may hold unhashable SymInts)."""

    collective: Node
    wait: Node
    input: Node
    key: Key
    shape: tuple[int | torch.SymInt, ...]
    """Sizes of the reduced tensor; SymInts under dynamic shapes."""
    nbytes: int
    """Bytes reduced (size hints for symbolic sizes)."""
    inplace: bool
    copy_back: Node | None
    ordinal: int
    """Place of the collective in the graph's issue sequence (rank-invariant)."""
    impl: str = "nccl"
    """"nccl" (the functional collective and its wait), or a ``LOWERED`` implementation, whose
    ``collective`` and ``wait`` are one node. Only NCCL blocks are merged or rewritten."""

    @property
    def numel(self) -> int | torch.SymInt:
        return numel(self.shape)

    @property
    def symbolic(self) -> bool:
        return not all(isinstance(s, int) for s in self.shape)

    @property
    def group(self) -> str | Node:
        """The collective's group argument as the graph passes it: a name or an FX node (what
        a collective replacing this one passes too)."""
        return arg_of(self.collective, "group_name")


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
    sequence: list[Node] = field(default_factory=list)
    """Every collective of the graph in node order: the order a rank issues them."""

    @property
    def all_reduce_count(self) -> int:
        return len(self.blocks) + len(self.skipped)


def op_of(node: Node):
    """The node's target, with Dynamo-level ``_c10d_functional.x`` packets read as ``x.default``
    (so :func:`find_comm_blocks` also reads graphs captured before AOTAutograd)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name.startswith(
            "_c10d_functional::"):
        return target.default
    return target


def lowered_impl(node: Node) -> str | None:
    """The ``LOWERED`` implementation ``node`` runs, or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return LOWERED.get(target._schema.name)


def is_all_reduce(node: Node) -> bool:
    return node.op == "call_function" and (op_of(node) in (ALL_REDUCE, ALL_REDUCE_)
                                           or lowered_impl(node) is not None)


def _looks_like_comm(node: Node) -> bool:
    """An opaque op outside ATen whose name says it communicates (e.g. vllm.all_reduce)."""
    target = op_of(node)
    namespace = getattr(target, "namespace", "")
    if namespace in ("aten", "_c10d_functional") or target in COPIES:
        return False
    name = getattr(target, "__name__", None) or str(target)
    text = f"{namespace}::{name}".lower()
    return any(w in text for w in COMM_WORDS) or "c10d" in text


def is_collective(node: Node) -> bool:
    """Does running ``node`` launch communication that peers must match (waits excluded)?"""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # the common case, decided by namespace
        namespace = target.namespace
        if namespace == "aten":
            return False
        if namespace == "_c10d_functional":
            return target is not WAIT
    target = op_of(node)
    if target is WAIT:
        return False
    return (target in (ALL_REDUCE, ALL_REDUCE_) or target in OTHER_COLLECTIVES
            or getattr(target, "namespace", "") == "_c10d_functional" or _looks_like_comm(node))


def op_name(node: Node) -> str:
    """The short name of the node's op: "all_reduce", "wait_tensor", "select", ..."""
    target = op_of(node)
    return getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)


def arg_of(node: Node, name: str, default=None):
    """The argument ``name`` of a call to an op with a schema, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(op_of(node), "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    i = names.index(name) if name in names else len(node.args)
    return node.args[i] if i < len(node.args) else default


def _lowered_block(node: Node, ordinal: int, impl: str) -> CommBlock | str:
    inp, val = node.args[0], tensor_val(node.args[0])
    group = group_identity(arg_of(node, "group_name"))
    if group is None or val is None:
        return f"{impl} all_reduce without a group name or input metadata"
    op = node.args[1] if isinstance(node.args[1], str) and len(node.args) > 2 else "sum"
    shape = tuple(val.shape)
    return CommBlock(collective=node, wait=node, input=inp,
                     key=Key(group=group, op=str(op), dtype=val.dtype, device=str(val.device)),
                     shape=shape, nbytes=hinted_numel(shape) * val.element_size(),
                     inplace=False, copy_back=None, ordinal=ordinal, impl=impl)


def _block_or_reason(node: Node, ordinal: int, order: dict[Node, int], sharing: dict
                     ) -> CommBlock | str:
    if (impl := lowered_impl(node)) is not None:
        return _lowered_block(node, ordinal, impl)
    inp, op, group = (arg_of(node, name) for name in ("input", "reduce_op", "group_name"))
    if not isinstance(inp, Node):
        return "input is not a graph node"
    key_group = group_identity(group)
    if key_group is None and isinstance(group, Node):
        return (f"group {group.name} is computed at run time by {group.target}: which "
                "all_reduces share it is unknown")
    if key_group is None:
        return f"group {group!r} is not a group name"
    if (why := left_alone(op)) is not None:  # a premul_sum's factor: no pass may drop it
        return why
    users = list(node.users)
    if len(users) != 1 or op_of(users[0]) is not WAIT:
        waits = sum(op_of(u) is WAIT for u in users)
        return (f"expected exactly one wait_tensor user inside the graph, found {waits} wait(s) "
                f"and {len(users) - waits} other user(s)")
    val = tensor_val(inp)
    if val is None:
        return "input has no tensor metadata (meta['val'])"
    if val.is_sparse:
        return "sparse input"
    inplace = op_of(node) is ALL_REDUCE_
    if inplace:
        if inp.op == "placeholder" or val._is_view():
            return "all_reduce_ mutates a graph input or a view; the mutation must stay visible"
        if any(order[u] > order[node] for u in inp.users if u is not node):
            return "all_reduce_ input is read again after the in-place collective"
        if len(sharing.get(storage_of(inp), ())) > 1:
            return "all_reduce_ input shares storage with other tensors (views) of the graph"
    wait = users[0]
    copy_back = next((u for u in wait.users if u.target in COPIES and u.args[1] is wait), None)
    shape = tuple(val.shape)
    return CommBlock(
        collective=node, wait=wait, input=inp,
        key=Key(group=key_group, op=reduce_op_name(op), dtype=val.dtype,
                device=str(val.device)),
        shape=shape, nbytes=hinted_numel(shape) * val.element_size(),
        inplace=inplace, copy_back=copy_back, ordinal=ordinal,
    )


def find_comm_blocks(graph: Graph) -> CommScan:
    """Classify every collective in ``graph`` (in node order, so results are deterministic)."""
    scan = CommScan()
    order = {n: i for i, n in enumerate(graph.nodes)}
    sharing: dict = {}  # storage -> nodes whose value lives in it (for in-place safety)
    if any(op_of(n) is ALL_REDUCE_ for n in graph.nodes):
        for n in graph.nodes:
            if op_of(n) not in (ALL_REDUCE_, WAIT) and (s := storage_of(n)) is not None:
                sharing.setdefault(s, []).append(n)
    off = _rewrites_off()
    for node in graph.nodes:
        if not is_collective(node):
            continue
        ordinal = len(scan.sequence)
        scan.sequence.append(node)
        if is_all_reduce(node):
            found = off or _block_or_reason(node, ordinal, order, sharing)
            if isinstance(found, CommBlock):
                scan.blocks.append(found)
            else:
                scan.skipped.append((node, found))
        elif op_of(node) in OTHER_COLLECTIVES:
            kind = OTHER_COLLECTIVES[op_of(node)]
            scan.other[kind] = scan.other.get(kind, 0) + 1
        elif getattr(op_of(node), "namespace", "") == "_c10d_functional":
            kind = op_name(node)
            scan.other[kind] = scan.other.get(kind, 0) + 1
        else:
            scan.unknown.append((node, f"opaque op {node.target} looks like communication; "
                                       "fxcoalesce only rewrites _c10d_functional.all_reduce"))
    return scan


def _rewrites_off() -> str | None:
    """Why no all_reduce may be rewritten on this torch (a canary of an internal the rewrites
    rely on failed: ``torch_internals``), or None. Every all_reduce is then left alone, and
    each graph compiles as plain Inductor compiles it."""
    from .torch_internals import disabled, reason

    return reason("rewrite") if "rewrite" in disabled() else None


MESH_GROUP = "_dtensor.mesh_get_process_group.default"
"""What a collective's group is under ``compile_on_one_rank`` (``torch.compiler.config``; in
2.13 ``torch.distributed.config``): an op resolving a device mesh's dimension to its group at
run time."""


def group_identity(group) -> str | None:
    """What identifies a collective's group within one graph: its name; or, for a group the
    graph computes (``compile_on_one_rank``: ``mesh_get_process_group(mesh, dim)`` of a mesh
    the graph takes as an input, or a process group input itself), how it is made, since two
    collectives reading one mesh input's same dimension share a group whatever rank runs the
    graph. None when neither says."""
    if isinstance(group, str):
        return group
    if not isinstance(group, Node):
        return None
    if group.op == "placeholder":
        return f"<input {group.name}>"
    if group.op == "call_function" and str(group.target) == MESH_GROUP and not group.kwargs:
        mesh, dim = (*group.args, None)[:2]
        if isinstance(mesh, Node) and mesh.op == "placeholder" and isinstance(dim, int):
            return f"<mesh {mesh.name} dim {dim}>"
    return None


def group_of(node: Node) -> str | None:
    """The name of a collective's group: its ``group_name`` argument, or the name of the
    process group an FX-node group resolved to when the graph was traced (None if neither)."""
    group = arg_of(node, "group_name")
    if isinstance(group, Node):
        group = getattr(group.meta.get("val"), "group_name", None)
    return group if isinstance(group, str) else None


def group_setup(scan: CommScan) -> tuple[int | None, str | None]:
    """(world size, backend name) of the group of the graph's first analysed all_reduce, or
    (None, None) when it has none or its group name does not resolve here."""
    import torch.distributed as dist

    for block in scan.blocks:
        try:
            group = dist.distributed_c10d._resolve_process_group(group_of(block.collective))
            return group.size(), dist.get_backend(group)
        except Exception:  # unknown group names (hand-built graphs): nothing to model
            return None, None
    return None, None


def describe(node: Node) -> str:
    """One collective as peers must match it: kind, scalar arguments, dtypes and shapes."""
    args = [reduce_op_name(a) if _is_reduce_op(a) else a for a in node.args[1:]
            if isinstance(a, (str, int, float)) or _is_reduce_op(a)]
    tensors = ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
                        for v in tensor_vals(node))
    text = f"{op_name(node)}({', '.join(map(str, args))}) -> {tensors}"
    if ORIGIN in node.meta:
        return f"{text} <- {node.meta[ORIGIN]}"
    sliced = node.meta.get(SLICED)
    return text + (f" of {sliced}" if sliced else "")


def _is_reduce_op(arg) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(arg, (dist.ReduceOp, dist.ReduceOp.RedOpType))


def issue_sequence(graph: Graph) -> list[tuple[str | None, str]]:
    """The collectives ``graph`` launches, in order: (group name, :func:`describe` string)."""
    return [(group_of(n), describe(n)) for n in graph.nodes if is_collective(n)]


def program_sequence(graph: Graph) -> list[tuple[str | None, str]]:
    """:func:`issue_sequence` of a graph the pipeline has not rewritten, each collective named
    by its own place as the pipeline names it (``meta.ORIGIN``): equal to the rewritten
    graph's sequence exactly when the passes kept the program's collectives and order."""
    return [(g, f"{d} <- #{i}") for i, (g, d) in enumerate(issue_sequence(graph))]


def sequence_after(before: GraphModule, after: GraphModule, report) -> list[tuple[str | None, str]]:
    """What ranks compare of the pipeline's output: its :func:`issue_sequence`; where the
    pipeline fell back to the graph it was given (whose collectives carry no ``meta.ORIGIN``),
    the program's own sequence, named as every other rank's unrewritten collectives are."""
    return program_sequence(before.graph) if report.fell_back else issue_sequence(after.graph)
