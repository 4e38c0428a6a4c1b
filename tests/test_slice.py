"""The slice pass: reduce only the part of an all_reduce's input that is read."""

from __future__ import annotations

import torch
from graphs import GraphBuilder, all_reduces, real_inputs, run

from fxcoalesce import Config, run_pipeline
from fxcoalesce.collectives import issue_sequence

aten = torch.ops.aten
SLICE_ONLY = Config(strict=True, passes=("slice",))


def last_token_graph(op="sum"):
    b = GraphBuilder()
    x = b.input("x", (2, 8, 16))
    w = b.all_reduce(b.add(x, x), op=op)
    return b.build(b.call(aten.select.int, w, 1, -1))        # w[:, -1]


def test_select_after_reduce_reduces_the_selection():
    gm = last_token_graph()
    out, report = run_pipeline(gm, SLICE_ONLY)
    (ar,) = all_reduces(out)
    # 2 x 16 floats reduced instead of 2 x 8 x 16
    assert tuple(ar.meta["val"].shape) == (2, 16)
    assert (report.all_reduce["bytes_before"], report.all_reduce["bytes_after"]) == (1024, 128)
    for want, got in zip(run(gm, real_inputs(gm)), run(out, real_inputs(gm)), strict=True):
        assert torch.equal(want, got)


def test_the_slice_is_part_of_the_issue_sequence():
    """Ranks compare sequences at compile time; a rank-dependent slice must show there, with
    the program's collective it reduces (#0)."""
    out, _ = run_pipeline(last_token_graph(), SLICE_ONLY)
    ((_, described),) = issue_sequence(out.graph)
    assert described.endswith("<- select(1, -1)(#0)")


def test_max_is_sliced_too():
    out, _ = run_pipeline(last_token_graph("max"), SLICE_ONLY)
    assert tuple(all_reduces(out)[0].meta["val"].shape) == (2, 16)


def test_left_alone_when_the_wait_has_another_user_or_a_tensor_index():
    b = GraphBuilder()
    x = b.input("x", (8, 16))
    w = b.all_reduce(b.add(x, x))
    gm = b.build(b.call(aten.slice.Tensor, w, 0, 0, 2), b.add(w, x))   # two users
    out, report = run_pipeline(gm, SLICE_ONLY)
    assert not report.passes[0]["changed"] and tuple(all_reduces(out)[0].meta["val"].shape) == (8, 16)
    b = GraphBuilder()
    x, idx = b.input("x", (8, 16)), b.input("idx", (3,), dtype=torch.int64)
    w = b.all_reduce(b.add(x, x))
    gm = b.build(b.call(aten.index.Tensor, w, [idx]))                    # values unseen
    _, report = run_pipeline(gm, SLICE_ONLY)
    assert not report.passes[0]["changed"]
