"""The slice pass keeps every graph output's strides: a program that returns strided views of
reduced tensors (view chains after all_reduces) gets from the backend what plain
torch.compile and eager give, strides and values (regression: 5 of 16 outputs came back
contiguous after the rewrite)."""

# run_checks=False: on a group of several ranks the graph's first all_reduce carries the
# run-time check and is never lowered, bucketed or sliced (tests/test_tag.py tests that);
# these tests are about the slice pass's strides.

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from graphs import GraphBuilder, all_reduces, real_inputs, run

import fxcoalesce
from fxcoalesce import Config, run_pipeline
from fxcoalesce.apps.launch import init_fake_group, spawn

aten = torch.ops.aten
CHAINS = [  # on an all_reduce of a [2, 8, 16] tensor; the first 8 run by default
    lambda w: w[:, -1],                                # select: strides (128, 1)
    lambda w: w[:, 2].t(),                             # a view of the slice
    lambda w: w[:, -1:].squeeze(1),
    lambda w: w[:, 1:5].transpose(0, 1) * 2,           # elementwise: follows its input's strides
    lambda w: w[:, 1:2].expand(2, 4, 16),              # stride 0
    lambda w: w.transpose(1, 2)[:, 0],                 # not a slice of the wait: left alone
    lambda w: w[1],                                    # dense anyway
    lambda w: w.view(2, 4, 2, 16)[:, :, 0],            # a view before the slice
    lambda w: w[:, 1:5].transpose(0, 1),
    lambda w: w[0, ::2],
    lambda w: w[..., 3:9],
    lambda w: w[:, :, 5],
    lambda w: w.reshape(16, 16)[3:7],
    lambda w: w[:, 2:6].permute(2, 0, 1),
    lambda w: w[:, 1:3].unsqueeze(0),
    lambda w: w.flatten(0, 1)[::3],
]
LEFT_ALONE = 5
"""The index in CHAINS of the one the slice pass does not rewrite."""


def program(chains):
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        return [f(funcol.all_reduce(x * (i + 1), "sum", dist.group.WORLD))
                for i, f in enumerate(chains)]
    return fn


def run_three(x: torch.Tensor, chains) -> dict[str, list[torch.Tensor]]:
    """Eager, plain torch.compile and the backend (the slice pass only) on ``x``."""
    fn = program(chains)
    torch._dynamo.reset()
    outs = {"eager": fn(x), "plain": torch.compile(fn, fullgraph=True)(x)}
    torch._dynamo.reset()
    backend = fxcoalesce.backend(Config(strict=True, run_checks=False, passes=("slice",)))
    outs["fxcoalesce"] = torch.compile(fn, backend=backend, fullgraph=True)(x)
    return outs


def check_same(outs: dict[str, list[torch.Tensor]]) -> None:
    for i, (want, plain, got) in enumerate(zip(outs["eager"], outs["plain"],
                                               outs["fxcoalesce"], strict=True)):
        assert got.stride() == plain.stride() == want.stride(), (i, got.stride(), want.stride())
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"output {i}")
        torch.testing.assert_close(plain, want, rtol=0, atol=0, msg=f"output {i}")


def sliced() -> int:
    return sum(d["chose"] == "slice" for r in fxcoalesce.reports() for d in r.decisions)


def test_hand_built_output_keeps_its_strides():
    """Tier 1: the rewritten graph's output has the unrewritten one's strides (a dense copy
    of the reduced selection, laid out as the view was), and the same values."""
    b = GraphBuilder()
    x = b.input("x", (2, 8, 16))
    w = b.all_reduce(b.add(x, x))
    gm = b.build(b.call(aten.t.default, b.call(aten.select.int, w, 1, 2)))
    out, _ = run_pipeline(gm, Config(strict=True, run_checks=False, passes=("slice",)))
    (ar,) = all_reduces(out)
    assert tuple(ar.meta["val"].shape) == (2, 16)  # the rewrite happened
    (o,) = out.graph.find_nodes(op="output")[0].args[0]
    assert o.target is aten.copy.default and o.meta["val"].stride() == (1, 128)
    (want,), (got,) = run(gm, real_inputs(gm)), run(out, real_inputs(gm))
    assert got.stride() == want.stride() and torch.equal(got, want)


def test_an_overlapping_output_is_left_alone():
    """An ``unfold`` of the slice overlaps its elements: no copy lays it out again, so the
    all_reduce stays whole."""
    b = GraphBuilder()
    x = b.input("x", (2, 8, 16))
    w = b.all_reduce(b.add(x, x))
    gm = b.build(b.call(aten.unfold.default, b.call(aten.select.int, w, 0, 1), 0, 4, 2))
    _, report = run_pipeline(gm, Config(strict=True, run_checks=False, passes=("slice",)))
    assert not report.passes[0]["changed"]


def test_view_chains_keep_strides_under_a_fake_group():
    init_fake_group(2)
    torch.manual_seed(0)
    fxcoalesce.clear_reports()
    check_same(run_three(torch.randn(2, 8, 16), CHAINS[:8]))
    assert sliced() == 7  # the rewrites happened: the strides were restored


def _ranks(rank: int, world: int, n: int) -> int:
    torch.set_num_threads(1)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(rank))
    check_same(run_three(x, CHAINS[:n]))
    return sliced()


@pytest.mark.slow
def test_view_chains_keep_strides_and_values_on_two_gloo_ranks():
    assert spawn(_ranks, 2, (len(CHAINS),), backend="gloo", timeout=600) == [15, 15]
