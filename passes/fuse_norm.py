"""fuse_norm: an all_reduce, the residual add after it and the RMSNorm after that, as one
kernel (``fxcoalesce.all_reduce_add_rms_norm``), where the calibrated profile says it wins.

Requires: comm blocks; runs before ``lower``. Matches, after the wait of a sum all_reduce
(bf16 or fp32, one consumer): ``add(wait, residual)`` then an RMSNorm of the sum over the
last dim (the pre-norm decoder's step after attention and after the MLP); or an RMSNorm of
the wait itself (the first layer's form, whose reduced value is the residual). The norm is
``aten.rms_norm``, ``aten._fused_rms_norm``, or the decomposed form models write by hand and
AOTAutograd emits, with or without weight, computed in fp32 (a bf16 ``x`` upcast first):

    c = x.float(); r = rsqrt(mean(c * c | c ** 2, -1, keepdim) + eps); y = c * r | r * c
    out = (y * w).to(x.dtype)      or      out = w * y.to(x.dtype)   (w * y, y * w alike)

It matches exactly what it replaces: every argument of every matched op is read by its
schema name, defaults filled in (``_call``), and must be as above, else no match: the residual
add's and eps's ``alpha`` 1 (``add(mean, 1.0, alpha=100)`` is mean + 100, no eps), eps a
number on the right of the add, the square ``pow`` exponent 2 (or ``c * c``), ``mean`` (no
``sum``, ``amax``) over the last dim only, ``keepdim=True``, its dtype none or fp32, ``rsqrt``
(no ``sqrt``/``reciprocal``), casts that change nothing but the dtype, ``normalized_shape``
``[H]``, the weight ``[H]`` of ``x``'s dtype or fp32; an argument a later torch adds is no
match either. tests/test_fuse_norm_property.py draws look-alikes and checks it.

Ensures: the matched nodes become one op whose outputs are the normalised value (for the
norm's consumers) and the new residual (for the sum's other consumers, usually the next
layer's add; unused in the output-only form). Values: the same sums and norm, rounded as
the fused kernel documents (within bf16 rounding of the unfused graph). Never fires through
a wait with another consumer, for fp16, avg or max, a norm over another dim, or where the
profile has no ``fused_add_rms_norm`` curve or predicts no saving over the best all_reduce
plus the add and norm kernels. The match reads compute after the wait (this rank's graph),
so ranks compare the result (``agreement``: a different eps shows in the description).

    before                                        after
    %w = wait(all_reduce(%x, "sum", "0"))         %f = all_reduce_add_rms_norm(%x, %h, %g,
    %s = add(%w, %h)                                                           1e-05, "0")
    %n = <rms_norm>(%s, %g, 1e-05)                %n = getitem(%f, 0)
    %o = add(%s, %mlp)                            %o = add(getitem(%f, 1), %mlp)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.operator_schemas import normalize_function

import fxcoalesce.kernels  # noqa: F401  (registers the fused op, also for cached code)
from fxcoalesce.analysis import analyze
from fxcoalesce.config import Config
from fxcoalesce.cost import Roofline, graph_device, node_us
from fxcoalesce.graph_order import reorder
from fxcoalesce.lowering import FUSED, profile_tag
from fxcoalesce.meta import (ORIGIN, REPLACES, fake_mode_of, is_scalar, origin, propagate_val,
                             replaced, same_shape, tensor_val)

from .decide import MIN_SAVING_SHARE, MIN_SAVING_US, Decider
from .result import Bucket, PassResult
from fxcoalesce.checked import pinned_blocks

aten, prims = torch.ops.aten, torch.ops.prims
F32 = torch.float32


@dataclass(slots=True)
class Norm:
    """An RMSNorm of ``source`` over its last dim: its nodes, output, weight and eps."""

    nodes: list[Node]
    out: Node
    weight: Node | None
    eps: float


def _only_user(n: Node) -> Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _is(n: Node | None, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _other(n: Node, known: Node):
    """The argument of a binary node that is not ``known`` (None if ``known`` is not one)."""
    a, b = n.args[:2]
    return b if a is known else a if b is known else None


def ANY(_) -> bool:
    """For an argument that cannot change the values (``non_blocking``, a copy's layout)."""
    return True


def _call(n: Node | None, targets, **want) -> dict | None:
    """``n``'s arguments by schema name (defaults filled in) if it calls one of ``targets``
    with every argument as ``want`` says: a node (that node), a predicate, or a value (equal);
    else None. An argument ``want`` does not name (one a later torch adds) is no match."""
    if not _is(n, *targets):
        return None
    bound = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True)
    if bound is None or set(bound.kwargs) != set(want):
        return None
    args = bound.kwargs
    ok = all(v is w if isinstance(w, Node) else w(v) if callable(w) else
             (not isinstance(v, Node) and v == w) for v, w in ((args[k], want[k]) for k in want))
    return args if ok else None


def _pair(n: Node | None, target, a, b, **rest) -> tuple[Node, object] | None:
    """(``n``, its operand matching ``b``) if ``n`` is ``target(a, b)`` or ``target(b, a)``
    (each a node or a predicate; ``rest``: the other arguments)."""
    for x, y in ((a, b), (b, a)):
        args = _call(n, (target,), input=x, other=y, **rest)
        if args is not None:
            return n, args["other"] if x is a else args["input"]
    return None


def _one(v) -> bool:
    return is_scalar(v) and v == 1


def _cast(n: Node | None, x: Node, dtype: torch.dtype) -> bool:
    """``n`` converts ``x`` to ``dtype`` and does nothing else."""
    if _call(n, (prims.convert_element_type.default,), a=x, dtype=dtype):
        return True
    device = tensor_val(x).device
    return _call(n, (aten._to_copy.default,), input=x, dtype=dtype,
                 layout=lambda v: v in (None, torch.strided),
                 device=lambda v: v is None or torch.device(v) == device,
                 pin_memory=lambda v: not v, non_blocking=ANY, memory_format=ANY) is not None


def _last_dim(ndim: int):
    return lambda dims: isinstance(dims, (list, tuple)) and list(dims) in ([-1], [ndim - 1])


def _weight(val) -> Callable[[object], bool]:
    """A weight the kernel takes for ``val``: a tensor of shape [hidden], of ``val``'s dtype
    or float32 (the kernel multiplies in float32: a float64 weight would not)."""
    def ok(w) -> bool:
        v = tensor_val(w)
        return (v is not None and v.dtype in (val.dtype, F32)
                and same_shape(v.shape, [val.shape[-1]]))
    return ok


def match_norm(source: Node) -> Norm | None:
    """The RMSNorm of ``source`` (its whole consumer, besides other readers of ``source``),
    every argument of every op checked; None for anything else."""
    val = tensor_val(source)
    if val is None or val.dim() < 1:
        return None
    hidden = val.shape[-1]
    for user in source.users:
        args = _call(user, (aten.rms_norm.default, aten._fused_rms_norm.default), input=source,
                     normalized_shape=lambda s: same_shape(list(s), [hidden]),
                     weight=lambda w: w is None or _weight(val)(w),
                     eps=lambda e: e is None or is_scalar(e))
        if args is not None:
            return _direct(user, args["weight"], args["eps"])
    # computed in float32: on the value itself, or on its upcast
    starts = [source] if val.dtype == F32 else []
    starts += [u for u in source.users if _cast(u, source, F32)]
    return next((n for n in (_decomposed(source, c, val) for c in starts) if n), None)


def _direct(n: Node, weight: Node | None, eps) -> Norm | None:
    if eps is None:  # aten's decomposition: float32's eps (the kernel computes in float32)
        eps = torch.finfo(torch.float32).eps
    if n.target is aten._fused_rms_norm.default:  # (out, rstd): only the output is read
        outs = list(n.users)
        if len(outs) != 1 or not _is(outs[0], operator.getitem) or outs[0].args[1] != 0:
            return None
        return Norm([n, outs[0]], outs[0], weight, float(eps))
    return Norm([n], n, weight, float(eps))


def _decomposed(source: Node, c: Node, val) -> Norm | None:
    """``c * rsqrt(mean(c * c | c ** 2, [-1], keepdim=True) + eps)``, then optionally the
    weight and the cast back to ``source``'s dtype in either order; ``c`` is ``source`` in
    float32."""
    sq = next((u for u in c.users
               if _call(u, (aten.pow.Tensor_Scalar,), input=c,
                        exponent=lambda e: is_scalar(e) and e == 2)
               or _call(u, (aten.mul.Tensor,), input=c, other=c)), None)
    mean = _only_user(sq) if sq is not None else None
    if not _call(mean, (aten.mean.dim,), input=sq, dim=_last_dim(val.dim()),
                 keepdim=lambda k: k is True, dtype=lambda d: d in (None, F32)):
        return None
    add = _only_user(mean)
    args = _call(add, (aten.add.Tensor, aten.add.Scalar), input=mean, other=is_scalar,
                 alpha=_one)  # eps, the right operand: add(mean, 1.0, alpha=100) is no norm
    if args is None:
        return None
    eps = float(args["other"])
    rs = _only_user(add)
    y = _only_user(rs) if _call(rs, (aten.rsqrt.default,), input=add) else None
    if not _pair(y, aten.mul.Tensor, c, rs):
        return None
    nodes, out, weight = [sq, mean, add, rs, y], y, None
    # optional cast back and weight, in either order
    for _ in range(2):
        nxt = _only_user(out)
        if _cast(nxt, out, val.dtype):
            out = nxt
        elif weight is None and (w := _pair(nxt, aten.mul.Tensor, out, _weight(val))):
            out, weight = w
        else:
            break
        nodes.append(out)
    # the norm's inside is read by nothing else; c (the upcast) only by the square and y
    if c is not source and (set(c.users) != {sq, y} or len(c.users) != 2):
        return None
    if any(len(n.users) != 1 for n in nodes[:-1]) or tensor_val(out).dtype != val.dtype:
        return None
    if weight in nodes or weight is c:
        return None
    return Norm(([c] if c is not source else []) + nodes, out, weight, eps)


@dataclass(slots=True)
class Site:
    block: object
    residual: Node | None
    sum: Node
    """What the norm reads: the add of the residual, or the wait itself (first layer)."""
    norm: Norm


def find_sites(analysis) -> list[Site]:
    """Every wait → [add residual] → RMSNorm the fused kernel can replace."""
    sites = []
    for info in analysis.infos:
        b = info.block
        val = tensor_val(b.input)
        if (b.impl != "nccl" or b.inplace or b.copy_back is not None or b.key.op != "sum"
                or val is None or val.dtype not in (torch.bfloat16, torch.float32)):
            continue
        users = list(b.wait.users)
        add = users[0] if len(users) == 1 else None
        if _pair(add, aten.add.Tensor, b.wait, ANY, alpha=_one) and _is_tensor_like(add, b.wait):
            norm = match_norm(add)
            if norm is not None:
                sites.append(Site(b, _other(add, b.wait), add, norm))
                continue
        norm = match_norm(b.wait)
        if norm is not None:
            sites.append(Site(b, None, b.wait, norm))
    return sites


def _is_tensor_like(add: Node, wait: Node) -> bool:
    other = _other(add, wait)
    a, b = tensor_val(wait), tensor_val(other)
    return (isinstance(other, Node) and other is not wait and b is not None
            and a.shape == b.shape and a.dtype == b.dtype)


def fuse_norm_pass(gm: GraphModule, *, cfg: Config, pinned: frozenset = frozenset()
                   ) -> PassResult:
    result = PassResult()
    analysis = analyze(gm)
    keep = pinned_blocks(analysis.scan, pinned)
    sites = [s for s in find_sites(analysis) if s.block not in keep]
    if not sites:
        return result
    decider = Decider.of(analysis, cfg)
    roof = Roofline.of(cfg.cost, graph_device(analysis))
    info_of = {i.block: i for i in analysis.infos}
    graph, mode = gm.graph, fake_mode_of(analysis.order)
    priority = {n: float(i) for n, i in analysis.order.items()}
    issue_keys = {n: float(i) for i, n in enumerate(analysis.scan.sequence)}
    for site in sites:
        b, info = site.block, info_of[site.block]
        costs, why = decider.costs(b.key, b.nbytes, info.ready, info.need)
        epilogue = sum(node_us(n, roof) for n in [*site.norm.nodes,
                                                  *([site.sum] if site.residual else [])])
        unfused = min(costs.values()) + epilogue
        fused_why = why.get(FUSED) or _fused_missing(cfg, b, decider, site)
        fused = None if fused_why else cfg.cost.impl_us(FUSED, b.nbytes, decider.world)
        margin = max(MIN_SAVING_US, MIN_SAVING_SHARE * unfused)
        chose = "fused" if fused is not None and fused < unfused - margin else "unfused"
        result.decisions.append({
            "members": [b.collective.name], "chose": chose, "bytes": b.nbytes,
            "predicted_us": {"fused": None if fused is None else round(fused, 2),
                             "unfused": round(unfused, 2)},
            "ruled_out": {FUSED: fused_why} if fused_why else {}, "local": True})
        if chose != "fused":
            continue
        at = priority[site.norm.out] - 0.5
        new = rewrite(graph, site, mode, cfg)
        priority.update({n: at for n in new})
        issue_keys[new[0]] = float(b.ordinal)
        result.buckets.append(Bucket(members=[b.collective.name], nbytes=b.nbytes,
                                     level=info.level, key=str(b.key), collective=new[0].name,
                                     kind=FUSED))
    if result.buckets:
        reorder(graph, priority, set(analysis.barriers), issue_keys)
        result.changed = True
    return result


def _fused_missing(cfg: Config, block, decider: Decider, site: Site) -> str | None:
    from fxcoalesce.lowering import options

    _, why = options(block.key, block.nbytes, decider.world, decider.backend, cfg, (FUSED,))
    if FUSED in why:
        return why[FUSED]
    if site.norm.weight is None:
        return "an RMSNorm without weight (the kernel takes one)"
    return None


def rewrite(graph, site: Site, mode, cfg: Config) -> list[Node]:
    """Replace ``site`` with the fused op; returns (fused, normed, residual_out) nodes."""
    b, norm = site.block, site.norm
    # read now: an earlier site's rewrite may have replaced the residual (its sum) already
    residual = None if site.sum is b.wait else _other(site.sum, b.wait)
    op = torch.ops.fxcoalesce.all_reduce_add_rms_norm.default
    with graph.inserting_before(norm.out):
        fused = graph.call_function(op, (b.input, residual, norm.weight, norm.eps,
                                         b.group))
        propagate_val(fused, mode)
        normed = graph.call_function(operator.getitem, (fused, 0))
        residual = graph.call_function(operator.getitem, (fused, 1))
    for n in (normed, residual):
        propagate_val(n, mode)
    fused.meta[REPLACES] = replaced([b.collective])
    fused.meta[ORIGIN] = f"{origin(b.collective)} [{profile_tag(cfg)}]"
    norm.out.replace_all_uses_with(normed)
    inside = set(norm.nodes)
    for user in list(site.sum.users):
        if user not in inside:
            user.replace_input_with(site.sum, residual)
    for n in reversed(norm.nodes):
        graph.erase_node(n)
    if site.sum is not b.wait:
        graph.erase_node(site.sum)
    graph.erase_node(b.wait)
    graph.erase_node(b.collective)
    return [fused, normed, residual]
