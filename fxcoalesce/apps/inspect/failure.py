"""Why a step failed to trace, in one line that says what to fix.

Dynamo reports an error inside the user's model as ``TorchRuntimeError: RuntimeError when
making fake tensor call``: the error itself (``shape '[1, 8, -1, 64]' is invalid for input of
size 768``) is chained below it, and which module raised it is nowhere. So when a trace fails,
the step runs once more, eagerly, on the same fake tensors (shapes only: nothing is computed)
with a forward pre-hook on every module and a ``TorchFunctionMode``: the modules it was inside
and the call that raised, with its tensors' shapes. If that run fails with the same error,
the message names the module (its path in the model), the call, the shapes and the TP
degree; a shape error on a sharded model is what a TP degree that does not divide the heads
gives, so it says to choose one that does.

    raise ValueError(explain(e, name="f.py:make", tp=8, located=locate(fn, args, mode, model)))
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

SHAPE_ERROR = re.compile(
    r"is invalid for input of size|must match the size of tensor|shapes cannot be multiplied|"
    r"size mismatch|split_with_sizes expects|doesn't match the broadcast shape|"
    r"not divisible|must be divisible|to be divisible|Expected size|but got size|"
    r"Mismatch in shape|Expected .*shape", re.I)
"""Errors about shapes that do not fit: on a sharded model, a TP degree that does not divide
what is sharded (heads) gives one of these."""


@dataclass(slots=True)
class Located:
    """Where the eager run failed: the module, the call and its tensors' shapes, the error."""

    path: str
    """The module's path in the model ("layers.0.attn"), "" for the model itself or when the
    model's modules are not known by name."""
    kind: str
    """The module's class name ("Attention")."""
    call: str | None
    """The torch call that raised ("view of a (1, 8, 96) tensor"), None if none did."""
    error: BaseException


def _dynamo_own(e: BaseException) -> bool:
    return type(e).__module__.startswith("torch._dynamo")


def cause(e: BaseException) -> BaseException:
    """The error Dynamo wraps: the first exception chained to ``e`` (``e`` included) that is
    not Dynamo's own; ``e`` when all are."""
    seen, x = [], e
    while x is not None and all(x is not s for s in seen):
        if not _dynamo_own(x):
            return x
        seen.append(x)
        x = x.__cause__ or x.__context__
    return e


def _shape_text(args) -> str:
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if not shapes:
        return ""
    if len(shapes) == 1:
        return f" of a {shapes[0]} tensor"
    return f" of {' and '.join(map(str, shapes))} tensors"


class _FailedCall(TorchFunctionMode):
    """Records the first torch call that raises (the outermost one: torch calls made inside
    it run with this mode off), its name and its tensors' shapes."""

    def __init__(self):
        super().__init__()
        self.call: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.call is None:
                name = getattr(func, "__name__", None) or str(func)
                self.call = f"{name}{_shape_text(args)}"
            raise


def locate(fn: Callable, args: tuple, mode, model: nn.Module | None) -> Located | None:
    """Run ``fn(*args)`` eagerly under the fake mode ``mode``; where it fails (None when it
    runs, or when even this cannot be found out). ``model`` names the modules by path."""
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    inside: list[nn.Module] = []

    def enter(module, _args):
        inside.append(module)

    def leave(module, _args, _out):
        while inside:
            if inside.pop() is module:
                break

    hooks = [nn.modules.module.register_module_forward_pre_hook(enter),
             nn.modules.module.register_module_forward_hook(leave)]
    calls = _FailedCall()
    try:
        with torch.no_grad(), mode, calls:
            fn(*args)
    except Exception as e:
        if not inside:
            return Located("", "", calls.call, e)
        module = inside[-1]
        return Located(names.get(id(module), ""), type(module).__name__, calls.call, e)
    finally:
        for h in hooks:
            h.remove()
    return None


def _raised_by_the_model(e: BaseException) -> bool:
    """Whether the model's own code raised ``e`` (its innermost frame is outside torch), as
    a model that checks its input raises; not an error of fake tensors themselves."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    return not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(torch_dir)


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _typed(e: BaseException) -> str:
    return f"{type(e).__name__}: {_line(e)}" if _line(e) else type(e).__name__


def _frame(e: BaseException) -> str:
    """' (at f.py:17, in forward)': the user's frame Dynamo was in, if it says."""
    stack = getattr(e, "real_stack", None)
    if not stack:
        return ""
    f = stack[-1]
    return f" (at {f.filename}:{f.lineno}, in {f.name})"


def explain(e: BaseException, *, name: str, tp: int, located: Located | None,
            verbose: bool = False) -> str:
    """One line for the trace's failure ``e``: what failed where, and what to do."""
    inner = cause(e)
    hint = "" if verbose else " (fxcoalesce -v inspect ... shows its traceback)"
    # the eager run's error is the trace's, or the trace failed in Dynamo itself (a graph
    # break, "Observed exception") where the model's own code raises without Dynamo too
    same = located is not None and (
        (type(located.error) is type(inner) and _line(located.error) == _line(inner))
        or (inner is e and _dynamo_own(e) and _raised_by_the_model(located.error)))
    if not same:
        return f"{name}: tracing its step failed: {_typed(inner)}{_frame(e)}{hint}"
    inner = located.error
    where = (f"{located.path} ({located.kind})" if located.path
             else f"the model ({located.kind})" if located.kind else "the model")
    call = f"{located.call}: " if located.call else ""
    if tp > 1 and SHAPE_ERROR.search(_line(inner)):
        return (f"{name} at TP {tp}: {where} cannot take its shard: {call}{_line(inner)}; a TP "
                "degree must divide what is sharded there (the number of heads, of key/value "
                f"heads): choose one that divides them{hint}")
    return f"{name}: tracing its step failed in {where}: {call}{_typed(inner)}{hint}"
