"""Tier 2: named models traced under a fake process group, through Inductor on CPU.

Counts come from the report and, independently, from Inductor's generated code.
"""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import fxcoalesce
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.models import apply_tp, build, check_tp, transformer
from fxcoalesce.apps.trace import trace_model

L = transformer.CONFIGS["neox-tiny"].n_layers


@pytest.mark.parametrize("name, after", [("neox-tiny", 1 + L), ("llama-tiny", 1 + 2 * L)])
def test_inspect_counts(name, after):
    r = trace_model(name, tp=4, tokens=3).report
    # neox: attention and MLP all_reduces of a block are independent -> one launch per block
    # llama: every all_reduce feeds the next block -> one chain, already at the bound
    assert r.all_reduce == {**r.all_reduce, "before": 1 + 2 * L, "after": after,
                            "lower_bound": after}
    assert ("already at its bound" in r.verdict) == (name == "llama-tiny")
    assert r.other_collectives == {"all_gather": 1}  # the LM head, counted and left alone


def test_hand_merged_matches_pass():
    auto = trace_model("neox-tiny", tp=2, tokens=3).report.all_reduce
    hand = trace_model("neox-tiny", tp=2, tokens=3, hand_merged=True).report.all_reduce
    assert hand["before"] == hand["lower_bound"] == auto["after"] == 1 + L
    # linearity sums attention and MLP partials before one reduction, as the hand merge does
    assert hand["bytes_before"] == auto["bytes_after"] < auto["bytes_before"]


def test_full_size_falcon_reaches_the_bound():
    """falcon-40b at full width, 8 layers: attention and MLP of each parallel block fused.
    (How the rewrite time grows with depth: benchmarks/trace_time.py.)"""
    layers = 8
    r = trace_model("falcon-40b", tp=8, tokens=3, layers=layers).report
    assert r.all_reduce["before"] == 1 + 2 * layers
    assert r.all_reduce["after"] == r.all_reduce["lower_bound"] == 1 + layers


@pytest.mark.parametrize("name", ["neox-tiny", "kimi-k2-tiny"])
@pytest.mark.parametrize("world", [2, 3, 16])
def test_check_tp_agrees_with_apply_tp(name, world):
    """The CLI rejects a TP degree by name (models.check_tp) before building anything; a
    degree it accepts must shard, and one it rejects must fail apply_tp the same way."""
    try:
        check_tp(name, world)
        expected = None
    except ValueError as e:
        expected = str(e)
    group = init_fake_group(world)
    try:
        if expected is None:
            apply_tp(build(name), group)
        else:
            with pytest.raises(ValueError) as caught:
                apply_tp(build(name), group)
            assert str(caught.value) == expected
    finally:
        torch.distributed.destroy_process_group()

def test_inductor_codegen_counts_and_values():
    init_fake_group(2)
    torch.manual_seed(0)
    model = apply_tp(build("neox-tiny"), torch.distributed.group.WORLD)
    # test_codegen's shapes (8 tokens): the run's one Inductor cache (conftest) holds the
    # kernels of whichever compiles first (this test alone: 12.6 s, 7.9 s after test_codegen)
    tokens = torch.randint(0, 512, (1, 8))
    fxcoalesce.clear_reports()
    with torch.no_grad():
        eager = model(tokens)  # the fake group's all_reduce returns its input unchanged
        compiled = torch.compile(model, backend=fxcoalesce.backend(
            fxcoalesce.Config(strict=True)), fullgraph=True)
        out, codes = run_and_get_code(compiled, tokens)
    code = "\n".join(codes)
    # Inductor turns each functional all_reduce into one in-place call on its buffer: one per
    # layer + the embedding's, and no functional one left
    FileCheck().check_count("torch.ops._c10d_functional.all_reduce_.default(", 1 + L,
                            exactly=True).run(code)
    FileCheck().check_not("torch.ops._c10d_functional.all_reduce.default(").run(code)
    assert fxcoalesce.reports()[-1].all_reduce["after"] == 1 + L
    torch.testing.assert_close(out, eager)



def test_a_hidden_size_override_scales_the_model_and_its_all_reduces():
    """``--dim`` of ``fxcoalesce bench`` (``models.args_of``): MLP widths and a dense model's
    heads scale, the head size stays."""
    from fxcoalesce import models

    base, wide = models.args_of("neox-tiny"), models.args_of("neox-tiny", 2, dim=256)
    assert (wide.dim, wide.n_layers, wide.head_dim) == (256, 2, base.head_dim)
    assert wide.inter_dim == base.inter_dim * 4 and wide.n_heads == base.n_heads * 4
    moe = models.args_of("kimi-k2-tiny", dim=128)
    assert (moe.dim, moe.moe_inter_dim) == (128, 2 * models.args_of("kimi-k2-tiny").moe_inter_dim)
    with pytest.raises(ValueError, match="head size"):
        models.args_of("neox-tiny", dim=72)
    model = build("neox-tiny", layers=2, dim=256)
    assert len(model.layers) == 2 and model.layers[0].mlp.w1.weight.shape == (1024, 256)
