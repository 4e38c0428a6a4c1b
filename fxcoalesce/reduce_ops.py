"""A collective's reduce op as a name, and what Dynamo does with ``dist.ReduceOp``.

Torch 2.15 lets ``funcol.all_reduce(x, dist.ReduceOp.SUM, group)`` through (its
``_c10d_functional.all_reduce`` takes ``Any reduce_op``; 2.13 raises on the enum). Dynamo
cannot put the enum in a graph: it breaks the graph at each such call, the all_reduce runs
eagerly between two compiled graphs, and no graph has an all_reduce to merge (results stay
right, the report says 0 -> 0). :func:`reduce_op_breaks` finds those breaks, so the report of
the graph compiled before one says so, and where; a graph that does hold the enum (traced by
``make_fx``, or built by hand) is read like one holding the string (:func:`reduce_op_name`).
"""

from __future__ import annotations

from .meta import is_torch_file

ADVICE = 'write the reduce op as a string: funcol.all_reduce(x, "sum", group)'
_SEEN = "_fxcoalesce_seen"


def reduce_op_name(op) -> str:
    """``"sum"`` for ``"sum"``, ``"SUM"``, ``dist.ReduceOp.SUM`` and its ``RedOpType``; other
    reduce ops alike ("avg", "max", ...); anything else as ``str()``."""
    if isinstance(op, str):
        return op.lower()
    name = getattr(op, "name", None)  # ReduceOp.RedOpType (what dist.ReduceOp.SUM is)
    if isinstance(name, str):
        return name.lower()
    op_type = getattr(op, "op", None)  # a dist.ReduceOp instance wraps its RedOpType
    if op_type is not None and isinstance(getattr(op_type, "name", None), str):
        return op_type.name.lower()
    return str(op)


PLAIN = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
"""The reduce ops whose name says all they do: a rewrite may re-emit one by its name."""
SUMMABLE = ("sum", "avg")
"""The plain reduce ops that commute with a sum (``passes/linearity.py`` merges only these)."""


def plain_reduce_op(op) -> str | None:
    """The name of ``op`` (as :data:`PLAIN` spells it) where its name says all it does, the
    op identified by its type: a string, a ``dist.ReduceOp.RedOpType`` member, or a
    ``dist.ReduceOp`` instance wrapping one. None for anything else: ``premul_sum`` in any
    form (its factor is not in its name: torch 2.15's functional all_reduce takes
    ``dist.ReduceOp`` objects, pytorch#190942, so a factor can reach a graph, and a pass that
    re-emitted the op by name would drop it), an op name not in :data:`PLAIN`, an object of
    another type. A collective with such an op stays as the program wrote it."""
    if isinstance(op, str):
        name = op.lower()
    else:
        try:
            import torch.distributed as dist
        except ImportError:  # no distributed in this build: no enum to read
            return None
        if not dist.is_available():
            return None
        if not isinstance(op, dist.ReduceOp.RedOpType) and isinstance(op, dist.ReduceOp):
            op = op.op  # the RedOpType it wraps; PREMUL_SUM's factor stays behind
        if not isinstance(op, dist.ReduceOp.RedOpType):
            return None
        name = op.name.lower()
    return name if name in PLAIN else None


def summable(op) -> bool:
    """Whether ``op`` is a plain sum or average, identified by type (:func:`plain_reduce_op`)."""
    return plain_reduce_op(op) in SUMMABLE


def left_alone(op) -> str | None:
    """Why a collective with reduce op ``op`` must stay as it is (None: it may be rewritten)."""
    if plain_reduce_op(op) is not None:
        return None
    name = reduce_op_name(op)
    what = ("carries a factor its name does not" if name == "premul_sum"
            else "is not one fxcoalesce knows")
    return f"reduce op {name} {what}: left as the program wrote it"


def reduce_op_breaks() -> list[str]:
    """One warning per graph break Dynamo made at a collective given a ``dist.ReduceOp`` since
    the last call (each break is reported once, by the first graph compiled after it): where
    it is, what it costs, what to write instead."""
    from .torch_internals import disabled

    if "break-report" in disabled():  # torch moved graph_break_reasons: nothing to read
        return []
    from torch._dynamo.utils import graph_break_reasons

    found = []
    for reason in graph_break_reasons:
        if getattr(reason, _SEEN, False) or "RedOpType" not in reason.reason:
            continue
        setattr(reason, _SEEN, True)
        frames = [f for f in reason.user_stack if not is_torch_file(f.filename)]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "a collective call"
        found.append(f"Dynamo broke the graph at {where}: a collective given dist.ReduceOp (torch "
                     f"2.15 accepts it, Dynamo cannot trace it), so it runs outside every "
                     f"compiled graph and fxcoalesce cannot merge it; {ADVICE}")
    return found
