"""``torch.ops.fxcoalesce.tag_after(Tensor ok, Tensor tag, str message) -> Tensor``: a copy of
``tag``, made only once ``ok`` (a tag check) holds: on CPU it raises
:class:`~fxcoalesce.CollectiveMismatchError` with ``message`` otherwise; on CUDA a
device-side assert stops the stream first (why a graph's second collective sends it:
``ranks.tag.plan``).
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("fxcoalesce", "FRAGMENT")
_lib.define("tag_after(Tensor ok, Tensor tag, str message) -> Tensor")


@torch.library.register_fake("fxcoalesce::tag_after")
def _fake(ok, tag, message):
    return torch.empty_like(tag)


def _cpu(ok, tag, message):
    if not bool(ok.all()):
        from fxcoalesce.errors import CollectiveMismatchError

        raise CollectiveMismatchError(message)
    return tag.clone()


def _cuda(ok, tag, message):
    torch._assert_async(ok.all(), message)
    return tag.clone()


_lib.impl("tag_after", _cpu, "CPU")
_lib.impl("tag_after", _cuda, "CUDA")
