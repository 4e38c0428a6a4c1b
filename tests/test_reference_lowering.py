"""``fuse_norm`` and ``lower`` fire on 2 gloo CPU ranks through the backend, their ops running
the references (``fxcoalesce.testing.reference_lowering``), and the compiled step equals eager
and plain torch.compile: fp32, 2 ranks, where the fused op's one fp32 rounding of the sum and
F.rms_norm's arithmetic agree with the unfused graph to fp32 roundoff (kernels/ops.py).
Regression: a look-alike ``torch.add(mean_sq, 1.0, alpha=100.0)`` was fused as eps 1.0 (up to
2.6 off eager); here it must stay as written, its all_reduce lowered to a one-shot instead."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import fxcoalesce
from fxcoalesce import Config, lowering
from fxcoalesce.apps.launch import spawn
from fxcoalesce.testing import reference_cost, reference_lowering

H = 32


def ar(t: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(t, "sum", dist.group.WORLD)


def hf_norm(s: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm."""
    v = s.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return w * v.to(s.dtype)


def look_alike(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    v = s.float()
    v = v * torch.rsqrt(torch.add(v.pow(2).mean(-1, keepdim=True), 1.0, alpha=100.0))
    return w * v.to(s.dtype)


def step(x, h, w, w2):
    h = funcol.all_reduce(h, "max", dist.group.WORLD)  # the first: carries the run-time
    s1 = h + ar(x)                                     # check, stays NCCL (ranks.tag)
    n1 = F.rms_norm(s1, (H,), w, 1e-5)          # fused
    s2 = s1 + ar(n1 @ w2)
    n2 = look_alike(s2, w)                       # not a norm: its all_reduce a one-shot
    s3 = s2 + ar(n2 @ w2)
    return hf_norm(s3, w, 1e-6), s3              # fused


def _no_symm(*args, **kwargs):
    raise AssertionError("symmetric memory prepared for a gloo group (a collective)")


def _ranks(rank: int, world: int, dtype: torch.dtype, with_plain: bool) -> dict:
    torch.set_num_threads(1)
    from fxcoalesce.kernels import symm

    symm.prepare = symm.symm_mem_ready = _no_symm  # this process only: none may run
    g = torch.Generator().manual_seed(rank)
    x, h = torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)
    w, w2 = torch.randn(H, generator=torch.Generator().manual_seed(9)), torch.randn(H, H) / H
    args = tuple(t.to(dtype) for t in (x, h, w, w2))
    eager = step(*args)
    plain = torch.compile(step, fullgraph=True)(*args) if with_plain else eager
    torch._dynamo.reset()
    fxcoalesce.clear_reports()
    with reference_lowering():
        cfg = Config(strict=True, cost=reference_cost(world), passes=("fuse_norm", "lower"))
        got = torch.compile(step, backend=fxcoalesce.backend(cfg), fullgraph=True)(*args)
        sequence = [("0", "one_shot_all_reduce(#1) -> float32[4, 32]")]
        no_problem = lowering.symm_problem(sequence, 1 << 20)
    (report,) = fxcoalesce.reports()
    return {"eager": eager, "plain": plain, "got": got, "symm_problem": no_problem,
            "chose": sorted((d["pass"], d["chose"]) for d in report.decisions),
            "launches": report.all_reduce["after"]}


@pytest.mark.parametrize("dtype, with_plain", [
    (torch.float32, False),
    pytest.param(torch.float32, True, marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, True, marks=pytest.mark.slow)])
def test_fused_and_one_shot_on_two_gloo_ranks_equal_eager(dtype, with_plain):
    """fp32: to roundoff; bf16: within twice plain torch.compile's distance from eager plus
    one bf16 rounding at the output's scale (the unfused graph rounds the sum and then the
    add, the fused op once: kernels/ops.py)."""
    for r in spawn(_ranks, 2, (dtype, with_plain), backend="gloo", timeout=300):
        # two true norms fused, the look-alike's all_reduce lowered instead, the first
        # all_reduce kept on the group's own all_reduce (it carries the check): four launches
        assert r["chose"] == [("fuse_norm", "fused"), ("fuse_norm", "fused"),
                              ("lower", "gloo all_reduce"), ("lower", "one_shot")]
        assert r["launches"] == 4
        assert r["symm_problem"] is None  # and no preparation ran (it raises here)
        for want, plain, got in zip(r["eager"], r["plain"], r["got"], strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(plain, want)
                torch.testing.assert_close(got, want)  # rtol 1.3e-6, atol 1e-5
                continue
            # bf16: the fused op rounds each layer's sum once where eager rounds twice (one
            # u = 2^-8 per element, kernels/ops.py), and the next layers carry that on as they
            # carry plain torch.compile's own roundings: within twice plain's distance from
            # eager plus one rounding at the output's scale (the look-alike fused: 2.6 off)
            want, plain, got = want.double(), plain.double(), got.double()
            bound = 2 * (plain - want).abs().max() + 2.0**-8 * want.abs().max()
            assert (got - want).abs().max() <= bound, ((got - want).abs().max(), bound)


def test_the_switch_shows_in_what_ranks_compare_and_ends_with_its_block():
    """Tier 1 (a fake group, CPU tensors): inside, the fused op replaces the norm and its
    description names the switch (ranks where it differs fall back together); outside, CPU
    tensors keep NCCL's all_reduce with the reason."""
    from graphs import calls
    from test_fuse_norm import block

    from fxcoalesce import run_pipeline
    from fxcoalesce.apps.launch import init_fake_group
    from fxcoalesce.collectives import issue_sequence

    init_fake_group(2)
    cfg = Config(strict=True, cost=reference_cost(2), passes=("fuse_norm", "lower"),
                 run_checks=False)  # the graph's only all_reduce: else kept for the check
    with reference_lowering():
        out, _ = run_pipeline(block(device="cpu", dtype=torch.float32), cfg)
    ((_, described),) = issue_sequence(out.graph)
    assert described.startswith("all_reduce_add_rms_norm(") and "reference lowering" in described
    out, report = run_pipeline(block(device="cpu", dtype=torch.float32), cfg)
    assert not calls(out, torch.ops.fxcoalesce.all_reduce_add_rms_norm.default)
    assert [d["chose"] for d in report.decisions] == ["unfused", "nccl"]
    assert report.decisions[0]["ruled_out"]["fused_add_rms_norm"].startswith("tensors on cpu")
