"""What Inductor's generated code overlaps: the kernels launched between each collective's
issue and its wait (CPU C++ and GPU Triton wrappers alike).

    torch.ops._c10d_functional.all_reduce_.default(buf21, 'sum', '0')     # issue
    extern_kernels.mm(buf27, arg10_1, out=buf28)                          # 1
    cpp_fused_gelu_3(buf29)                                               # 2
    torch.ops._c10d_functional.wait_tensor.default(buf21)                 # wait: 2 kernels

This reads the code a run really executes, which is what overlap must be judged on: the FX
graph's order is only a request, and Inductor fuses and reorders after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_COLLECTIVE = re.compile(
    r"(?:(?P<out>buf\w+)\s*=\s*)?torch\.ops\._c10d_functional\.(?P<op>(?!wait_tensor)\w+)"
    r"\.default\((?P<arg>[^,)]+)")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((?P<arg>[^,)]+)")
_KERNEL = re.compile(
    r"^\s*(?:\w+\s*=\s*)?(?:cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|"
    r"torch\.ops\.(?!_c10d_functional)\w+\.\w+\.\w+\(|aten\.\w+\.\w+\()")
_BUF = re.compile(r"(buf\d+|arg\d+_\d+)")


@dataclass(frozen=True, slots=True)
class Window:
    """One collective in the generated code and the kernels it overlaps."""

    op: str
    buffer: str
    issue_line: int
    wait_line: int | None
    kernels: int
    """Kernel launches between the issue and its wait (None-waited: to the end)."""
    early_reads: tuple[int, ...] = ()
    """Lines between issue and wait that name the collective's buffer: reads before the
    data has arrived (a race), unless the line is the wait itself."""


def _buffer(arg: str) -> str:
    found = _BUF.search(arg)
    return found.group(1) if found else arg.strip()


def call_body(code: str) -> list[str]:
    """The lines of the wrapper's ``call`` function (where kernels are launched)."""
    lines = code.splitlines()
    start = next((i for i, l in enumerate(lines) if re.match(r"\s*def call\(", l)), 0)
    return lines[start:]


def collective_windows(code: str) -> list[Window]:
    """Every collective launched by ``code`` (Inductor output), in issue order."""
    lines = call_body(code)
    open_: dict[str, tuple[str, int]] = {}
    kernels_at: list[int] = []
    reads: dict[str, list[int]] = {}
    done: list[Window] = []
    for i, line in enumerate(lines):
        if (m := _COLLECTIVE.search(line)) is not None:
            buf = m.group("out") or _buffer(m.group("arg"))
            open_[buf] = (m.group("op"), i)
            reads[buf] = []
        elif (m := _WAIT.search(line)) is not None:
            buf = _buffer(m.group("arg"))
            if buf in open_:
                op, start = open_.pop(buf)
                n = sum(start < k < i for k in kernels_at)
                done.append(Window(op, buf, start, i, n, tuple(reads.pop(buf))))
        elif _KERNEL.search(line):
            kernels_at.append(i)
            for buf in open_:
                if re.search(rf"\b{buf}\b", line):
                    reads[buf].append(i)
    for buf, (op, start) in open_.items():
        done.append(Window(op, buf, start, None, sum(k > start for k in kernels_at)))
    return sorted(done, key=lambda w: w.issue_line)
