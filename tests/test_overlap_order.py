"""Tier 3: the collective order of the code Inductor generates after fxcoalesce, on every rank,
with Inductor's own comm scheduling on: ``simple_overlap`` (on by default since torch 2.14:
it moves collectives and waits in the schedule) and the ``raise_comms`` / ``sink_waits`` /
``reorder_compute_for_overlap`` passes the backend turns on where they are right (2.14+).

The graphs differ between ranks (``test_rank_order.CASES``: a bias on rank 0, a branch on odd
ranks), so a scheduler that places collectives by where compute lands could order them
differently per rank. Read from each rank's generated code: its collectives (op, reduce op,
buffer shape) in launch order must be the sequence fxcoalesce agreed on, the same on every rank,
and the values those of eager.
"""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from test_rank_order import CASES, _inputs, eager

import fxcoalesce
from fxcoalesce.apps.bench.code_overlap import call_body
from fxcoalesce.torch_releases import COMM_REORDER_RIGHT_FROM, torch_version
from fxcoalesce.apps.launch import spawn
from fxcoalesce.collectives import issue_sequence

ORDERED = ("sum_bias_then_max", "extra_compute_between", "rank_branch")
"""Cases whose collectives differ in reduce op or size: a swap shows in the code itself."""

_LAUNCH = re.compile(r"torch\.ops\._c10d_functional\.(?P<op>(?!wait_tensor)\w+?)_?\.default\("
                     r"(?P<buf>\w+), '(?P<reduce>\w+)'")
_ALLOC = re.compile(r"^\s*(?P<buf>buf\d+) = empty_strided_\w+\(\((?P<shape>[^)]*)\)")
_REUSE = re.compile(r"^\s*(?P<buf>buf\d+) = (?P<old>buf\d+); del \w+\s+# reuse")


def launched(code: str) -> list[tuple[str, str, tuple[int, ...] | None]]:
    """(op, reduce op, shape of its buffer) of every all_reduce ``code`` launches, in order."""
    shapes: dict[str, tuple[int, ...]] = {}
    out = []
    for line in call_body(code):
        if (m := _ALLOC.match(line)) is not None:
            shapes[m["buf"]] = tuple(int(s) for s in m["shape"].replace(" ", "").split(",") if s)
        elif (m := _REUSE.match(line)) is not None and m["old"] in shapes:
            shapes[m["buf"]] = shapes[m["old"]]
        elif (m := _LAUNCH.search(line)) is not None:
            out.append((m["op"], m["reduce"], shapes.get(m["buf"])))
    return out


def agreed(sequence) -> list[tuple[str, str, tuple[int, ...]]]:
    """The same triples from fxcoalesce's issue sequence ("all_reduce(sum, 0) -> float32[8, 16]")."""
    out = []
    for _, text in sequence:
        m = re.match(r"(\w+?)_?\((\w+), .*-> \w+\[([\d, ]*)\]", text)
        out.append((m[1], m[2], tuple(int(s) for s in m[3].split(",") if s.strip())))
    return out


def _compile_cases(rank, world, options):
    from torch._inductor.graph import GraphLowering

    torch.set_num_threads(1)
    results = {}
    for name in CASES:
        fn, overrides, _ = CASES[name]
        args = _inputs(rank)
        graphs, codes = [], []
        be = fxcoalesce.backend(fxcoalesce.Config(strict=True, **overrides), options=options,
                                on_graph=lambda b, a, r: graphs.append(a))
        torch._dynamo.reset()
        with mock.patch.object(GraphLowering, "save_output_code", codes.append), \
                torch.no_grad():
            got = torch.compile(fn, backend=be, fullgraph=True)(*args)
        (code,) = codes
        results[name] = {"code": launched(code), "agreed": agreed(issue_sequence(graphs[-1].graph)),
                         "got": got, "want": eager(fn, args)}
    return results


def _option_sets():
    """The backend as it comes (2.14+: simple_overlap, then the reorder passes after the
    fxcoalesce passes) and, where those passes run by default, without them."""
    # CI runs them under the newest torch (.ci/tests-newest.txt), where both sets apply
    sets = [pytest.param(None, id="backend-defaults", marks=pytest.mark.other_torch)]
    if torch_version() >= COMM_REORDER_RIGHT_FROM:
        sets.append(pytest.param({"reorder_for_compute_comm_overlap": False},
                                 id="simple_overlap-alone"))
    return sets


@pytest.mark.parametrize("options", _option_sets())
def test_generated_code_keeps_the_agreed_order_on_every_rank(options):
    res = spawn(_compile_cases, 2, (options,), backend="gloo", timeout=600)
    for name in CASES:
        per_rank = [r[name] for r in res]
        for r in per_rank:
            for got, want in zip(r["got"], r["want"], strict=True):
                torch.testing.assert_close(got, want)
            # the code launches what fxcoalesce agreed, in that order (shapes where the code
            # names the buffer's allocation)
            assert [(op, red) for op, red, _ in r["code"]] == \
                [(op, red) for op, red, _ in r["agreed"]], name
            assert all(s is None or s == a[2] for (_, _, s), a in zip(r["code"], r["agreed"])), name
        assert all(r["agreed"] == per_rank[0]["agreed"] for r in per_rank), name
        assert all(r["code"] == per_rank[0]["code"] for r in per_rank), name
    # the shapes were read: the test compares more than op names
    assert any(s is not None for r in res for n in ORDERED for _, _, s in r[n]["code"])
