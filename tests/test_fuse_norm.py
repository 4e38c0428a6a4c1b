"""Tier 1: the ``fuse_norm`` pass matches wait -> add(residual) -> RMSNorm (and the first-layer
and output-only forms; aten's rms_norm and the decomposed forms nn.RMSNorm and Hugging Face
write) and, where a calibrated profile says it wins, makes it one
``fxcoalesce.all_reduce_add_rms_norm``; its arithmetic against the unfused graph."""

# run_checks=False: on a group of several ranks the graph's first all_reduce carries the
# run-time check and is never lowered, bucketed or sliced (tests/test_tag.py tests that);
# these tests are about the fuse_norm pass's own matching.

from __future__ import annotations

import json
import operator

import pytest
import torch
import torch.distributed as dist
from graphs import GraphBuilder, all_reduces, calls
from torch.fx import Graph, GraphModule

import fxcoalesce.kernels  # noqa: F401  (the op)
from fxcoalesce import Config, CostModel, analyze, run_pipeline
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.collectives import ALL_REDUCE, WAIT, issue_sequence
from fxcoalesce.meta import fake_mode_of
from fxcoalesce.passes.fuse_norm import find_sites, rewrite

aten, prims = torch.ops.aten, torch.ops.prims
FUSED = torch.ops.fxcoalesce.all_reduce_add_rms_norm.default
F32 = torch.float32


def flat(us: float) -> dict:
    return {"segments": [{"up_to_bytes": 1 << 30, "alpha_us": us, "beta_us_per_byte": 0.0}],
            "max_bytes": 1 << 30}


@pytest.fixture
def fused_wins(tmp_path) -> CostModel:
    """NCCL 20 µs, one-shot 10 µs, the fused kernel 4 µs (add and norm included)."""
    data = {"backend": "nccl", "device": "cuda", "world_size": 2, "alpha_us": 20.0,
            "beta_us_per_byte": 0.0, "segments": flat(20.0)["segments"],
            "implementations": {"one_shot": flat(10.0), "fused_add_rms_norm": flat(4.0)}}
    (tmp_path / "p.json").write_text(json.dumps(data))
    return CostModel.from_profile(tmp_path / "p.json")


def val(b: GraphBuilder, name: str, shape, dtype, device):
    node = b.graph.placeholder(name)
    with b.mode:
        node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
    return node


def decomposed_norm(b: GraphBuilder, s, w, eps=1e-5, style="nn", dim=-1):
    """nn.RMSNorm as AOTAutograd emits it, or Hugging Face's (weight times the cast back)."""
    dtype = s.meta["val"].dtype
    c = b.call(prims.convert_element_type.default, s, F32) if dtype != F32 else s
    r = b.call(aten.rsqrt.default, b.call(aten.add.Scalar, b.call(
        aten.mean.dim, b.call(aten.pow.Tensor_Scalar, c, 2), [dim], True), eps))
    y = b.call(aten.mul.Tensor, c, r)
    if style == "hf":
        y = b.call(prims.convert_element_type.default, y, dtype) if dtype != F32 else y
        return b.call(aten.mul.Tensor, w, y)
    z = b.call(aten.mul.Tensor, y, w)
    return b.call(prims.convert_element_type.default, z, dtype) if dtype != F32 else z


def block(form="residual", *, dtype=torch.bfloat16, device="cuda", op="sum", style="nn",
          eps=1e-5, dim=-1, second_reader=False, residual_read=False):
    """x -> all_reduce -> (+ residual) -> RMSNorm -> mm, the sum also read by a later add
    (the next layer's residual stream), as in a pre-norm decoder."""
    b = GraphBuilder()
    x, h = val(b, "x", (1, 4, 64), dtype, device), val(b, "h", (1, 4, 64), dtype, device)
    w = val(b, "w", (64,), dtype, device)
    reduced = b.all_reduce(b.call(aten.mul.Tensor, x, 2.0), op=op)
    s = reduced if form == "first-layer" else b.add(reduced, h)
    if form == "direct":
        normed = b.call(aten.rms_norm.default, s, [64], w, eps)
    else:
        normed = decomposed_norm(b, s, w, eps, style, dim)
    outs = [b.call(aten.mul.Tensor, normed, 3.0)]
    if form != "output-only":
        outs.append(b.add(s, x))
    if second_reader:
        outs.append(b.call(aten.neg.default, reduced))
    if residual_read:  # the old residual read elsewhere too: the op changes no input
        outs.append(b.call(aten.neg.default, h))
    return b.build(*outs)


def fuse(gm, cost, passes=("fuse_norm",)):
    return run_pipeline(gm, Config(strict=True, run_checks=False, cost=cost, passes=passes))


@pytest.fixture(autouse=True)
def fake_group():
    init_fake_group(2)


@pytest.mark.parametrize("form, style", [("residual", "nn"), ("residual", "hf"),
                                         ("first-layer", "nn"), ("output-only", "nn"),
                                         ("direct", "nn")])
def test_fused_where_the_profile_says_it_wins(fused_wins, form, style):
    out, report = fuse(block(form, style=style), fused_wins)
    # one fused op in the all_reduce's place: no NCCL all_reduce, wait or norm left
    (f,) = calls(out, FUSED)
    assert not all_reduces(out) and not calls(out, WAIT)
    assert not calls(out, aten.rsqrt.default) and not calls(out, aten.rms_norm.default)
    assert (f.args[1] is None) == (form == "first-layer")
    # the norm's consumer reads output 0, the residual stream's add output 1
    getitems = {u.args[1]: u for u in f.users}
    assert [u.target for u in getitems[0].users] == [aten.mul.Tensor]
    assert [u.target for u in getitems.get(1, f).users] == (
        [] if form == "output-only" else [aten.add.Tensor])
    (d,) = report.decisions
    assert d["chose"] == "fused" and d["predicted_us"]["fused"] == 4.0
    assert report.all_reduce["after"] == 1  # still one all_reduce launch


def test_the_residual_read_elsewhere_still_fuses(fused_wins):
    """Unlike an in-place fused add + norm (vLLM's), this op writes new tensors: another
    reader of the old residual keeps reading it."""
    out, _ = fuse(block(residual_read=True), fused_wins)
    (f,) = calls(out, FUSED)
    h = next(n for n in out.graph.find_nodes(op="placeholder") if n.name == "h")
    assert f.args[1] is h and {u.target for u in h.users} == {FUSED, aten.neg.default}


def test_consecutive_layers(fused_wins):
    """Layer 2's residual is layer 1's sum, which layer 1's rewrite replaces: layer 2 reads
    layer 1's residual output (found on the GPU: the stale residual broke the pass)."""
    b = GraphBuilder()
    x, h = val(b, "x", (1, 4, 64), torch.bfloat16, "cuda"), val(b, "h", (1, 4, 64),
                                                                torch.bfloat16, "cuda")
    w = val(b, "w", (64,), torch.bfloat16, "cuda")
    s1 = b.add(b.all_reduce(b.call(aten.mul.Tensor, x, 2.0)), h)
    n1 = decomposed_norm(b, s1, w)
    s2 = b.add(b.all_reduce(b.call(aten.mul.Tensor, n1, 2.0)), s1)
    out, report = fuse(b.build(decomposed_norm(b, s2, w), s2), fused_wins)
    f1, f2 = calls(out, FUSED)
    assert [d["chose"] for d in report.decisions] == ["fused", "fused"]
    # layer 2's residual argument is layer 1's residual output
    assert f2.args[1].target is operator.getitem and f2.args[1].args == (f1, 1)
    out.graph.lint()


@pytest.mark.parametrize("case, why", [
    ({"second_reader": True}, None),  # the raw sum is read elsewhere: nothing to fuse
    ({"dtype": torch.float16}, None),
    ({"op": "avg"}, None),
    ({"dim": 1}, None),  # a norm over another dim
    ({"device": "cpu"}, "tensors on cpu: symmetric memory needs CUDA"),
])
def test_left_alone(fused_wins, case, why):
    out, report = fuse(block(**case), fused_wins)
    assert len(all_reduces(out)) == 1 and not calls(out, FUSED)
    assert [d["ruled_out"].get("fused_add_rms_norm") for d in report.decisions] == (
        [why] if why else [])


def test_not_chosen_without_a_curve_or_a_saving(tmp_path):
    data = {"backend": "nccl", "device": "cuda", "world_size": 2, "alpha_us": 20.0,
            "beta_us_per_byte": 0.0, "segments": flat(20.0)["segments"],
            "implementations": {"one_shot": flat(2.0)}}
    (tmp_path / "p.json").write_text(json.dumps(data))
    (d,) = fuse(block(), CostModel.from_profile(tmp_path / "p.json"))[1].decisions
    assert d["chose"] == "unfused" and "no fused_add_rms_norm curve" in d["ruled_out"][
        "fused_add_rms_norm"]
    # a fused kernel slower than what lower would run (a one-shot) + the add and norm: unfused
    data["implementations"]["fused_add_rms_norm"] = flat(9.0)
    (tmp_path / "q.json").write_text(json.dumps(data))
    out, report = fuse(block(), CostModel.from_profile(tmp_path / "q.json"),
                       passes=("fuse_norm", "lower"))
    assert report.decisions[0]["chose"] == "unfused" and not calls(out, FUSED)


def test_eps_is_part_of_what_ranks_compare(fused_wins):
    """A rank whose norm has another eps (its graph differs) issues another description:
    the ranks' comparison sees it and they fall back together."""
    seqs = [issue_sequence(fuse(block(eps=eps), fused_wins)[0].graph) for eps in (1e-5, 1e-6)]
    assert seqs[0] != seqs[1]
    assert seqs[0][0][1].startswith("all_reduce_add_rms_norm(1e-05, 0) -> bfloat16[1, 4, 64]")


def test_a_norm_without_eps_fuses_with_atens_default(fused_wins):
    """``nn.RMSNorm(dim)`` and ``F.rms_norm`` leave eps None: aten then uses float32's eps
    (what the decomposition computes with for bf16 and fp32), and so does the fused op."""
    out, _ = fuse(block("direct", eps=None), fused_wins)
    (f,) = calls(out, FUSED)
    assert torch.finfo(torch.float32).eps in f.args


def identity_collectives(gm: GraphModule) -> GraphModule:
    """A runnable copy of ``gm`` whose all_reduces return their input (one rank's sum)."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in list(graph.nodes):
        if n.target in (ALL_REDUCE, WAIT):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    return GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form, eps", [("residual", 1e-5), ("first-layer", 1e-5),
                                       ("direct", 1e-5), ("direct", None)])
def test_arithmetic_matches_the_unfused_graph(form, eps, dtype):
    """The rewrite on CPU (the choice bypassed), one process: the fused op's reference sums
    over no peers. fp32: equal to roundoff; bf16: the unfused graph rounds the sum and then
    the add, the op rounds once (kernels/ops.py bounds it); bf16's own tolerance covers it."""
    dist.destroy_process_group()
    gm = block(form, dtype=dtype, device="cpu", eps=eps)
    analysis = analyze(gm)
    (site,) = find_sites(analysis)
    unfused = identity_collectives(gm)
    rewrite(gm.graph, site, fake_mode_of(analysis.order), Config())
    gm.recompile()
    fused = identity_collectives(gm)
    assert len(calls(fused, FUSED)) == 1
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(tuple(n.meta["val"].shape), generator=gen).to(dtype)
              for n in gm.graph.find_nodes(op="placeholder")]
    want = unfused(*inputs)
    got = fused(*inputs)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w)  # fp32: 1.3e-6 rtol; bf16: 1.6e-2 rtol (1 ulp)
