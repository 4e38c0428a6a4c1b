"""Fake (meta) kernels for torch's symm_mem all_reduce ops, where the running torch has none.

torch 2.11 (and the 2.13 CPU wheel) give ``symm_mem::one_shot_all_reduce`` and
``one_shot_all_reduce_copy`` a Meta kernel but not ``two_shot_all_reduce_`` nor the ``_out``
forms, so FakeTensorMode, dynamo and Inductor's fake propagation refuse a graph holding one.
``ensure_symm_mem_fakes()`` registers shape-only fakes for those, and only those: an op that
already has a Meta, composite or Python fake kernel keeps torch's own. Idempotent.
"""

from __future__ import annotations

import torch


def _one_shot(input, reduce_op, group_name):
    return torch.empty_like(input)


def _one_shot_out(input, reduce_op, group_name, out):
    return out


def _one_shot_copy(symm_buffer, local_input, reduce_op, group_name):
    return torch.empty_like(local_input)


def _one_shot_copy_out(symm_buffer, local_input, reduce_op, group_name, out):
    return out


def _two_shot_(input, reduce_op, group_name):
    return input  # in place: the result is the input (schema Tensor(a!) -> Tensor(a!))


def _two_shot_out(input, reduce_op, group_name, output):
    return output


FAKES = {
    "one_shot_all_reduce": _one_shot,
    "one_shot_all_reduce_out": _one_shot_out,
    "one_shot_all_reduce_copy": _one_shot_copy,
    "one_shot_all_reduce_copy_out": _one_shot_copy_out,
    "two_shot_all_reduce_": _two_shot_,
    "two_shot_all_reduce_out": _two_shot_out,
}
"""The symm_mem ops a pass may insert, and the fake each gets where torch has none."""

_KERNEL_KEYS = ("Meta", "CompositeImplicitAutograd", "CompositeExplicitAutograd")
_lib: torch.library.Library | None = None


def has_fake(qualname: str) -> bool:
    """Whether FakeTensorMode can run ``qualname`` ("ns::op", default overload): a Meta or
    composite kernel registered for it directly, or a Python fake impl. (The *computed*
    Meta entry is no guide: it reads True through fallbacks for ops that cannot trace.)"""
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, k) for k in _KERNEL_KEYS):
        return True
    from torch._library.simple_registry import singleton

    return singleton.find(qualname).fake_impl.kernel is not None


def ensure_symm_mem_fakes() -> tuple[str, ...]:
    """Register a fake for each op of ``FAKES`` that this torch has and cannot fake-run;
    returns the names registered by this call (empty when there was nothing left to do)."""
    global _lib
    added = []
    for name, fake in FAKES.items():
        qualname = f"symm_mem::{name}"
        if not hasattr(torch.ops.symm_mem, name) or has_fake(qualname):
            continue
        if _lib is None:
            _lib = torch.library.Library("symm_mem", "FRAGMENT")
        torch.library.register_fake(qualname, fake, lib=_lib)
        added.append(name)
    return tuple(added)
