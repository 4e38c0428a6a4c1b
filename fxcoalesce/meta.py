"""Keep ``node.meta["val"]`` right on nodes that a pass creates."""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Node
from torch.utils._pytree import tree_map


def propagate_val(node: Node, mode: FakeTensorMode | None = None) -> None:
    """Compute ``node.meta["val"]`` by running its target on its inputs' fake values."""
    args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a,
                            (node.args, node.kwargs))
    mode = mode or detect_fake_mode(args) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def fake_mode_of(nodes) -> FakeTensorMode | None:
    vals = [n.meta.get("val") for n in nodes]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
