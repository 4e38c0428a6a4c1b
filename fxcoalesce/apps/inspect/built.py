"""What each front door of ``inspect`` builds: a sharded model's step and its fake inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


@dataclass(slots=True)
class Built:
    """A step to trace: ``fn(*args)`` under ``mode``, whose fake tensors its parameters are."""

    fn: Callable
    args: tuple
    mode: FakeTensorMode
    what: str
    """One line: the model, its size, how it was sharded, its input."""
    parameters: int
    """Parameters of the unsharded model."""
    model: nn.Module | None = None
    """The sharded model ``fn`` runs: its modules' paths name where a failed trace failed."""


def parameter_count(module: nn.Module) -> int:
    """Parameters of ``module`` (tied ones once), on any device, fake or meta included."""
    return sum(p.numel() for p in module.parameters())


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception: what one line of error can hold."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
