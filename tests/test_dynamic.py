"""Symbolic sizes: dynamic=True, and torch's automatic dynamic on a second input length.

A server sees many prompt lengths; from the second one on torch recompiles with symbolic
sizes. The passes bucket those all_reduces too (cat / split over SymInt sizes, read back with
sym_size / sym_numel), so the fusion holds at every length.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from graphs import GraphBuilder, calls, run
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import fxcoalesce
from fxcoalesce import Config, run_pipeline
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.models import apply_tp, build

aten = torch.ops.aten


def test_symbolic_pair_is_bucketed_and_exact_at_other_sizes():
    b = GraphBuilder(dynamic=True)
    x = b.input("x", (4, 8), dynamic=True)
    y = b.input("y", (3, 8), dynamic=True)
    wx, wy = b.all_reduce(b.add(x, x)), b.all_reduce(b.mm(y, b.call(aten.t.default, y)))
    gm = b.build(b.add(wx, x), wy)
    out, report = run_pipeline(gm, Config(strict=True))
    # one launch for both; split sizes are read off the inputs at run time
    assert (report.all_reduce["before"], report.all_reduce["after"]) == (2, 1)
    assert len(calls(out, aten.sym_numel.default)) == 2
    # run at sizes other than the traced hints: the graph must not have baked them in
    for shapes in [((4, 8), (3, 8)), ((6, 5), (2, 7))]:
        inputs = [torch.randn(s, dtype=torch.float32) for s in shapes]
        for got, want in zip(run(out, inputs), run(gm, inputs), strict=True):
            assert torch.equal(got, want)


def test_report_counts_symbolic_all_reduces_in_the_bound():
    b = GraphBuilder(dynamic=True)
    x = b.input("x", (4, 8), dynamic=True)
    chain = b.all_reduce(b.all_reduce(x))
    _, report = run_pipeline(b.build(chain), Config(strict=True))
    # analysed, not left alone: a two-link chain is at its bound
    assert report.all_reduce["left_alone"] == 0
    assert report.verdict.startswith("already at its bound")


@pytest.fixture
def neox_tp2():
    """neox-tiny with 2 of its 4 layers: 5 all_reduces, 3 after (a symbolic Inductor compile
    of all 4 took 30-36 s on 2 loaded cores; the fusion is per layer)."""
    init_fake_group(2)
    torch.manual_seed(0)
    return apply_tp(build("neox-tiny", layers=2), dist.group.WORLD)


def test_dynamic_true_inductor_code_has_the_fused_launches(neox_tp2):
    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(neox_tp2, backend=fxcoalesce.backend(Config(strict=True)),
                             fullgraph=True, dynamic=True)
    tokens = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        out, (code,) = run_and_get_code(compiled, tokens)
        want = neox_tp2(tokens)
    (report,) = fxcoalesce.reports()
    # 5 -> 3 on a graph whose sizes are symbols, and the generated code issues 3
    assert (report.all_reduce["before"], report.all_reduce["after"]) == (5, 3)
    # the wrapper checks the tokens' length as a symbol, not as 6: compiled for any length
    # (torch 2.15 checks several inputs in one assert_size_stride_grouped call)
    FileCheck().check_regex(r"assert_size_stride(_grouped)?\(.*\(1, s\d+\)").run(code)
    # and issues the 3 all_reduces, each in place on its buffer
    FileCheck().check_count("_c10d_functional.all_reduce_.default(", 3, exactly=True).run(code)
    FileCheck().check_not("_c10d_functional.all_reduce.default(").run(code)
    torch.testing.assert_close(out, want)


def test_second_length_recompiles_symbolic_and_keeps_the_fusion(neox_tp2):
    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(neox_tp2, backend=fxcoalesce.backend(
        Config(codegen="eager", strict=True)), fullgraph=True)
    with torch.no_grad():
        for n in (5, 7, 9):  # 5: static; 7: automatic dynamic recompile; 9: reuses it
            tokens = torch.randint(0, 512, (1, n))
            torch.testing.assert_close(compiled(tokens), neox_tp2(tokens))
    static, dynamic = fxcoalesce.reports()
    assert all((r.all_reduce["before"], r.all_reduce["after"]) == (5, 3)
               for r in (static, dynamic))
    # the first graph is static, the recompiled one symbolic (bytes from size hints)
    assert not any(w["symbolic"] for w in static.windows)
    assert all(w["symbolic"] for w in dynamic.windows)


def hf_gpt_neox_tp2():
    """Hugging Face GPT-NeoX (parallel residual), sharded by torch's own parallelize_module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=128,
                        use_parallel_residual=True, max_position_embeddings=64)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg).eval()
    plan = {}
    for i in range(cfg.num_hidden_layers):
        layer = f"gpt_neox.layers.{i}"
        plan |= {f"{layer}.attention.query_key_value": ColwiseParallel(),
                 f"{layer}.attention.dense": RowwiseParallel(),
                 f"{layer}.mlp.dense_h_to_4h": ColwiseParallel(),
                 f"{layer}.mlp.dense_4h_to_h": RowwiseParallel()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(model, mesh, plan)


def test_hf_gpt_neox_two_lengths():
    """The issue's case: 6 -> 3 with static shapes, and still 6 -> 3 from the second length."""
    init_fake_group(2)
    model = hf_gpt_neox_tp2()
    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    step = torch.compile(lambda ids: model(input_ids=ids, use_cache=False).logits,
                         backend=fxcoalesce.backend(Config(codegen="eager", strict=True)),
                         fullgraph=True)
    with torch.no_grad():
        for n in (5, 7):
            step(torch.randint(0, 128, (1, n)))
    counts = [(r.all_reduce["before"], r.all_reduce["after"]) for r in fxcoalesce.reports()]
    assert counts == [(6, 3), (6, 3)]
