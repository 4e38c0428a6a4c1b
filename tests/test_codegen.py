"""Tier 2: what Inductor's generated code does with the collectives (fake process group, CPU).

The FX order is only a request: Inductor fuses and reorders after the passes. These tests read
the code a run executes (``fxcoalesce.apps.bench.code_overlap``): the collectives come out in the
order the passes chose, and when collectives stay separate the compute between issue and wait
is at least what plain torch.compile gets.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

import fxcoalesce
from fxcoalesce.apps.bench.code_overlap import collective_windows
from fxcoalesce.apps.bench.variants import has_triton
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.apps.steps import make_step
from fxcoalesce.collectives import issue_sequence
from fxcoalesce.models import apply_tp, build


@pytest.fixture(scope="module")
def steps():
    """(callable, args) for neox-tiny forward and kimi-k2-tiny verify at TP 2, 8 tokens."""
    init_fake_group(2)
    out = {}
    for name, step in (("neox-tiny", "forward"), ("kimi-k2-tiny", "verify")):
        torch.manual_seed(0)
        model = apply_tp(build(name), dist.group.WORLD)
        fn, args = make_step(model, step, 8)
        out[name] = (fn, (torch.randint(0, model.args.vocab, args[0].shape), *args[1:]))
    return out


def compiled_code(fn, args, backend) -> str:
    torch._dynamo.reset()
    with torch.no_grad():
        _, (code,) = run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True), *args)
    return code


def all_reduce_windows(code):
    return [w for w in collective_windows(code) if w.op.startswith("all_reduce")]


@pytest.mark.parametrize("name", ["neox-tiny",  # kimi-k2-tiny: 70 s loaded, slow
                                  pytest.param("kimi-k2-tiny", marks=pytest.mark.slow)])
def test_separate_collectives_keep_at_least_plain_overlap(steps, name):
    fn, args = steps[name]
    plain = all_reduce_windows(compiled_code(fn, args, "inductor"))
    ours = all_reduce_windows(compiled_code(
        fn, args, fxcoalesce.backend(fxcoalesce.Config(passes=("schedule",)))))
    # same launches (neox-tiny 1 + 2 x 4, kimi-k2-tiny 12: nothing merges without the bucket
    # and linearity passes); plain Inductor hides kernels under some of them, and every
    # collective hides at least as many as under plain Inductor
    assert len(ours) == len(plain) == {"neox-tiny": 9, "kimi-k2-tiny": 12}[name]
    assert sum(p.kernels for p in plain) > 0
    assert all(o.kernels >= p.kernels for o, p in zip(ours, plain, strict=True))


@pytest.mark.other_torch  # 27 s: CI runs it under the newest torch (.ci/tests-newest.txt)
def test_generated_code_issues_collectives_in_the_passes_order(steps):
    fn, args = steps["kimi-k2-tiny"]
    graphs = []
    code = compiled_code(fn, args, fxcoalesce.backend(
        fxcoalesce.Config(), on_graph=lambda b, a, r: graphs.append(a)))
    (after,) = graphs
    fx_sizes = [d.split("-> ")[1] for _, d in issue_sequence(after.graph)]
    # the wrapper launches the collectives in the FX graph's issue order, one for one
    launched = collective_windows(code)
    assert len(launched) == len(fx_sizes) == 10  # 9 all_reduces (the bound) + the head's gather
    assert [w.op.rstrip("_") for w in launched] == [
        "all_reduce" if "all_reduce" in d else "all_gather_into_tensor"
        for _, d in issue_sequence(after.graph)]


def test_fused_code_has_fewer_launches_than_plain(steps):
    fn, args = steps["neox-tiny"]
    plain = all_reduce_windows(compiled_code(fn, args, "inductor"))
    ours = all_reduce_windows(compiled_code(fn, args, fxcoalesce.backend()))
    assert (len(plain), len(ours)) == (9, 5)


OVERLAP_BUCKETING = {"aten_distributed_optimizations.enable_overlap_scheduling": True,
                     "aten_distributed_optimizations.collective_bucketing": True,
                     "aten_distributed_optimizations.collective_estimator": "analytical",
                     "aten_distributed_optimizations.compute_estimator": "analytical"}


@pytest.mark.skipif(not set(OVERLAP_BUCKETING) <= set(torch._inductor.list_options())
                    or not has_triton(), reason=f"torch {torch.__version__} has no overlap "
                    "scheduler with collective bucketing, or no Triton for it")
@pytest.mark.parametrize("name, launches", [("neox-tiny", 5), ("kimi-k2-tiny", 9)])
def test_inductor_overlap_bucketing_after_fxcoalesce_keeps_one_summed_launch_per_level(
        steps, name, launches):
    """Both bucketings fire (fxcoalesce's, then Inductor 2.15's overlap scheduler with
    collective_bucketing): the code still launches one all_reduce per level, the sums
    fxcoalesce made, not a concatenation of them."""
    fn, args = steps[name]
    reports = []
    code = compiled_code(fn, args, fxcoalesce.backend(
        options=OVERLAP_BUCKETING, on_graph=lambda b, a, r: reports.append(r)))
    (report,) = reports
    assert len(all_reduce_windows(code)) == report.all_reduce["after"] == \
        report.all_reduce["lower_bound"] == launches
    kinds = {b["kind"] for b in report.buckets}
    assert "sum" in kinds and "cat" not in kinds
