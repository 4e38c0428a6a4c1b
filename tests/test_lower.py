"""Tier 1-2: the ``lower`` pass chooses each all_reduce's implementation from a calibrated
profile (fixed profiles here), on hand-built graphs of fake CUDA tensors under the fake
process group, which stands for the NCCL group the profile was measured on."""

# run_checks=False: on a group of several ranks the graph's first all_reduce carries the
# run-time check and is never lowered, bucketed or sliced (tests/test_tag.py tests that);
# these tests are about the lower pass's own choices.

from __future__ import annotations

import json

import pytest
import torch
from graphs import GraphBuilder, all_reduces, calls

import fxcoalesce
from fxcoalesce import Config, CostModel, run_pipeline
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.collectives import issue_sequence

ONE_SHOT = torch.ops.symm_mem.one_shot_all_reduce.default
TWO_SHOT = torch.ops.symm_mem.two_shot_all_reduce_.default
MiB = 1 << 20


def curve(alpha_us: float, beta_us_per_byte: float, max_bytes: int = 64 * MiB) -> dict:
    return {"segments": [{"up_to_bytes": max_bytes, "alpha_us": alpha_us,
                          "beta_us_per_byte": beta_us_per_byte}], "max_bytes": max_bytes}


def profile(tmp_path, *, backend="nccl", world=2, one_shot=curve(4.0, 2e-5, MiB),
            two_shot=curve(12.0, 2e-6), name="p.json") -> CostModel:
    """NCCL 15 µs + 4 µs/MB; one-shot 4 µs + 20 µs/MB up to 1 MiB; two-shot 12 µs + 2 µs/MB."""
    nccl = curve(15.0, 4e-6)
    data = {"backend": backend, "device": "cuda", "world_size": world, "alpha_us": 15.0,
            "beta_us_per_byte": 4e-6, "segments": nccl["segments"], "implementations": {
                k: v for k, v in (("one_shot", one_shot), ("two_shot", two_shot)) if v}}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return CostModel.from_profile(path)


@pytest.fixture(autouse=True)
def fake_group():
    init_fake_group(2)


def cuda_input(b: GraphBuilder, name: str, shape, dtype=torch.bfloat16):
    node = b.graph.placeholder(name)
    with b.mode:
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="cuda")
    return node


def one_reduction(shape=(16, 4096), dtype=torch.bfloat16, op="sum"):
    """x @ w, all_reduce, + x: a row-parallel projection and its residual add."""
    b = GraphBuilder()
    x, w = cuda_input(b, "x", shape, dtype), cuda_input(b, "w", (shape[1], shape[1]), dtype)
    return b.build(b.add(b.all_reduce(b.mm(x, w), op=op), x))


def lowered(cost: CostModel, gm=None, **cfg):
    return run_pipeline(gm or one_reduction(), Config(strict=True, run_checks=False, cost=cost,
                                                      passes=("lower",), **cfg))


def test_one_shot_where_the_profile_predicts_it_faster(tmp_path):
    out, report = lowered(profile(tmp_path))
    # 128 KiB: NCCL 15.5 µs, one-shot 6.6 µs, two-shot 12.3 µs -> one-shot, in the collective's
    # place: no NCCL all_reduce or wait left
    assert len(calls(out, ONE_SHOT)) == 1 and not all_reduces(out)
    (d,) = report.decisions
    assert d["chose"] == "one_shot" and d["bytes"] == 16 * 4096 * 2
    assert d["predicted_exposed_us"] == {"nccl": pytest.approx(15.52, abs=0.01),
                                         "one_shot": pytest.approx(6.62, abs=0.01),
                                         "two_shot": pytest.approx(12.26, abs=0.01)}
    # the report still counts it as the graph's one all_reduce launch
    assert (report.all_reduce["before"], report.all_reduce["after"]) == (1, 1)
    # ranks compare which program collective it runs and the profile that chose it
    ((_, described),) = issue_sequence(out.graph)
    assert described.startswith("one_shot_all_reduce(sum, 0) -> bfloat16[16, 4096] <- #0 ")
    assert described.endswith(f"[profile {report.decisions and lowered_digest(tmp_path)}]")


def lowered_digest(tmp_path) -> str:
    import hashlib

    return hashlib.sha256((tmp_path / "p.json").read_bytes()).hexdigest()[:12]


def test_two_shot_for_large_sizes(tmp_path):
    out, report = lowered(profile(tmp_path), one_reduction((512, 4096)))
    # 4 MiB: past one-shot's calibrated 1 MiB; two-shot 20.4 µs < NCCL 31.8 µs
    (d,) = report.decisions
    assert d["chose"] == "two_shot" and "one_shot" in d["ruled_out"]
    assert "past the largest size calibrated for one_shot" in d["ruled_out"]["one_shot"]
    assert len(calls(out, TWO_SHOT)) == 1
    # in place on the matmul's own output, which nothing else reads: no copy
    assert not calls(out, torch.ops.aten.clone.default)


@pytest.mark.parametrize("case, reason", [
    ({"dtype": torch.float16}, "float16: the kernels take bf16 or fp32"),
    ({"op": "avg"}, "op avg: the symmetric-memory kernels only sum"),
])
def test_stays_nccl_with_the_reason(tmp_path, case, reason):
    out, report = lowered(profile(tmp_path), one_reduction(**case))
    (d,) = report.decisions
    assert d["chose"] == "nccl" and d["ruled_out"]["one_shot"] == reason
    assert len(all_reduces(out)) == 1 and not calls(out, ONE_SHOT)


def test_stays_nccl_without_a_curve_or_on_other_setups(tmp_path):
    # a profile without symmetric-memory curves (older profiles, CPU ones): NCCL only
    (d,) = lowered(profile(tmp_path, one_shot=None, two_shot=None))[1].decisions
    assert d["chose"] == "nccl" and "has no one_shot curve" in d["ruled_out"]["one_shot"]
    # a gloo setup
    (d,) = lowered(profile(tmp_path, backend="gloo", name="g.json"))[1].decisions
    assert d["ruled_out"]["one_shot"] == "a gloo group: symmetric memory needs an NCCL group"
    # CPU tensors
    b = GraphBuilder()
    x = b.input("x", (16, 64))
    (d,) = lowered(profile(tmp_path), b.build(b.all_reduce(x)))[1].decisions
    assert d["ruled_out"]["one_shot"] == "tensors on cpu: symmetric memory needs CUDA"
    # world size 3
    init_fake_group(3)
    (d,) = lowered(profile(tmp_path, world=3, name="w3.json"))[1].decisions
    assert d["ruled_out"]["one_shot"] == "world size 3: the kernels run at 1, 2, 4 or 8 ranks"
    # the eager codegen cannot place buffers in symmetric memory
    init_fake_group(2)
    (d,) = lowered(profile(tmp_path), codegen="eager")[1].decisions
    assert "eager codegen" in d["ruled_out"]["one_shot"]


def test_a_group_the_graph_computes_stays_nccl(tmp_path):
    """``compile_on_one_rank``: the group is an FX node (an input here); the symmetric-memory
    ops take a group's name, so the all_reduce stays NCCL, with the reason."""
    b = GraphBuilder()
    x = cuda_input(b, "x", (16, 4096))
    group = b.graph.placeholder("pg")
    group.meta["val"] = "0"  # what the fake kernels see of it
    out, report = lowered(profile(tmp_path), b.build(b.add(b.all_reduce(x, group=group), x)))
    (d,) = report.decisions
    assert d["chose"] == "nccl" and "a group the graph computes" in d["ruled_out"]["one_shot"]
    assert len(all_reduces(out)) == 1 and not calls(out, ONE_SHOT)


def test_switched_off(tmp_path):
    for cfg in ({"lower": False}, {"disable": ("lower",)}):
        out, report = run_pipeline(one_reduction(), Config(
            strict=True, run_checks=False, cost=profile(tmp_path), **cfg))
        assert "lower" not in [p["name"] for p in report.passes]
        assert not calls(out, ONE_SHOT) and len(all_reduces(out)) == 1


def test_near_ties_keep_nccl(tmp_path):
    # one-shot 15 µs flat vs NCCL 15.5 µs: under the margin (1 µs, 10%)
    (d,) = lowered(profile(tmp_path, one_shot=curve(15.0, 0.0, MiB), two_shot=None))[1].decisions
    assert d["chose"] == "nccl"


def two_independent(shape=(32, 4096)):
    """Two independent all_reduces with next to no compute around them (no window to hide
    NCCL in: merging costs no overlap)."""
    b = GraphBuilder()
    x = cuda_input(b, "x", shape)
    mul = torch.ops.aten.mul.Tensor
    return b.build(b.all_reduce(b.call(mul, x, 2.0)), b.all_reduce(b.call(mul, x, 3.0)))


def test_merge_and_lowering_decided_together(tmp_path):
    """Two 256 KiB all_reduces: merged, one 512 KiB one-shot (14.5 µs; NCCL 17.1) against two
    one-shots apart (2 x 9.2): merged, then one-shot. A one-shot of 2 µs + 5 µs/MB calibrated
    only to 256 KiB: apart, two one-shots (2 x 3.3 µs) against the merged 512 KiB's only
    choice, NCCL (17.1 µs): apart, each a one-shot. (No two-shot curve in either profile.)"""
    cfg = dict(strict=True, passes=("bucket", "lower"))
    out, report = run_pipeline(two_independent(), Config(
        run_checks=False, cost=profile(tmp_path, two_shot=None), **cfg))
    bucket, lower = [d for d in report.decisions if d["pass"] == "bucket"], \
        [d for d in report.decisions if d["pass"] == "lower"]
    assert [d["chose"] for d in bucket] == ["merge all"]
    assert [d["chose"] for d in lower] == ["one_shot"] and lower[0]["bytes"] == 512 << 10
    cheap = profile(tmp_path, one_shot=curve(2.0, 5e-6, 256 << 10), two_shot=None,
                    name="cheap.json")
    out, report = run_pipeline(two_independent(), Config(run_checks=False, cost=cheap, **cfg))
    assert [d["chose"] for d in report.decisions if d["pass"] == "bucket"] == ["separate"]
    assert [d["chose"] for d in report.decisions if d["pass"] == "lower"] == ["one_shot"] * 2
    assert len(calls(out, ONE_SHOT)) == 2


def test_rank_dependent_graphs_lower_alike(tmp_path):
    """Rank 1 adds a bias before the first all_reduce: its compute differs, its sizes do not,
    so both ranks issue the same lowered sequence (and allocate the same symmetric buffers,
    which Inductor does in that order)."""
    cost = profile(tmp_path)

    def rank_graph(rank):
        b = GraphBuilder()
        x, w = cuda_input(b, "x", (16, 4096)), cuda_input(b, "w", (4096, 4096))
        h = b.mm(x, w)
        if rank == 1:
            h = b.add(h, x)
        a = b.all_reduce(h)
        return b.build(b.all_reduce(b.mm(a, w)), b.all_reduce(b.add(x, x)))

    seqs = [issue_sequence(run_pipeline(rank_graph(r), Config(
        strict=True, run_checks=False, cost=cost))[0].graph) for r in (0, 1)]
    assert seqs[0] == seqs[1]
    assert [d.split(" <- ")[0].split("(")[0] for _, d in seqs[0]] == ["one_shot_all_reduce"] * 2


def test_default_cost_model_never_lowers():
    """Without a calibrated profile nothing but NCCL has a prediction: choices come from
    measurement, never from a fixed rule."""
    out, report = run_pipeline(one_reduction(), Config(strict=True, run_checks=False))
    (d,) = [d for d in report.decisions if d["pass"] == "lower"]
    assert d["chose"] == "nccl" and "one_shot" in d["ruled_out"]
    assert fxcoalesce.analyze(out).scan.blocks[0].impl == "nccl"
    assert CostModel().impl_missing("one_shot", 1024).startswith("no cost profile has no "
                                                                 "one_shot curve")


def test_under_cuda_graphs_one_shot_runs_on_a_copy(tmp_path):
    """mode="reduce-overhead": Inductor's own P2P buffers break torch 2.11's CUDA-graph trees
    (measured on one H200), so the one-shot runs on a copy in fxcoalesce's workspace, and
    the two-shot is ruled out with the reason."""
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        out, report = lowered(profile(tmp_path))
        (d,) = report.decisions
        assert d["chose"] == "one_shot" and d["variant"].startswith("copy-in")
        assert len(calls(out, torch.ops.fxcoalesce.one_shot_all_reduce.default)) == 1
        assert not calls(out, ONE_SHOT)
        (d,) = lowered(profile(tmp_path), one_reduction((512, 4096)))[1].decisions
        assert d["chose"] == "nccl" and "CUDA-graph trees" in d["ruled_out"]["two_shot"]


def test_distinct_graphs_draw_distinct_p2p_buffer_ids(tmp_path):
    """Inductor names each P2P buffer with Python's ``random`` at code generation, and dynamo
    restores Python's random state after every compile, so without the pass's seeding every
    graph's first buffer gets one id and a second graph of another size fails on the GPU
    (measured, torch 2.11). After ``lower``, the next draw depends on the graph: distinct
    shapes, distinct ids; the same graph, the same ids."""
    import random

    def next_id(shape, cfg=None):
        random.seed(0)  # what every compile starts from, whatever the graph
        with torch._guards.tracing(torch._guards.TracingContext(None)):  # inside a compile
            lowered(profile(tmp_path), one_reduction(shape), **(cfg or {}))
        return random.randint(0, 2**64 - 1)

    assert next_id((16, 4096)) == next_id((16, 4096))
    assert next_id((16, 4096)) != next_id((3, 4096))
    random.seed(0)
    untouched = random.randint(0, 2**64 - 1)
    assert next_id((16, 4096), {"lower": False}) == untouched  # nothing lowered
    random.seed(0)
    lowered(profile(tmp_path), one_reduction((16, 4096)))
    assert random.randint(0, 2**64 - 1) == untouched  # outside a compile: nothing seeded


def test_dynamo_restores_python_random_around_each_compile():
    """The torch behaviour the seeding above answers: two graphs compiled one after the other
    draw the same Python random numbers during their compiles."""
    import random

    draws = []

    def backend(gm, example_inputs):
        draws.append(random.randint(0, 2**64 - 1))
        return gm.forward

    f = torch.compile(lambda x: x + 1, backend=backend, dynamic=False)
    f(torch.ones(2)), f(torch.ones(3))
    assert len(draws) == 2 and draws[0] == draws[1]


def test_the_workspace_is_sized_for_what_runs_on_it(tmp_path):
    """Only the copy-in one-shot (under CUDA graphs) and the fused op run on fxcoalesce's
    workspace; a zero-copy one-shot's input is Inductor's own P2P buffer."""
    from fxcoalesce.lowering import lowered_bytes

    _, report = lowered(profile(tmp_path))
    assert report.decisions[0]["chose"] == "one_shot" and lowered_bytes([report]) == 0
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        _, report = lowered(profile(tmp_path))
    assert lowered_bytes([report]) == 16 * 4096 * 2


# --- nccl_symm (issue 22 §1) ---------------------------------------------------------------

import fxcoalesce.kernels  # noqa: E402,F401  (registers the op)

NCCL_SYMM = torch.ops.fxcoalesce.nccl_symm_all_reduce.default


def with_nccl_symm(tmp_path, name="ns.json") -> CostModel:
    """``profile`` plus nccl_symm at 3 µs + 1 µs/MB: the fastest of all at 128 KiB (3.1 µs)."""
    data = json.loads((profile(tmp_path, name=name), (tmp_path / name).read_text())[1])
    data["implementations"]["nccl_symm"] = curve(3.0, 1e-6)
    (tmp_path / name).write_text(json.dumps(data))
    return CostModel.from_profile(tmp_path / name)


def backend_is(monkeypatch, backend):
    from fxcoalesce.kernels import nccl_symm

    monkeypatch.setattr(nccl_symm, "process_backend", lambda: backend)


def test_nccl_symm_where_the_backend_is_nccls(tmp_path, monkeypatch):
    """With NCCL's symmetric memory the process's backend, nccl_symm wins at 128 KiB and
    takes the collective's place, on a copy (the variant says why); the one-shot and
    two-shot are ruled out by the backend, not by time."""
    from fxcoalesce.lowering import lowered_bytes

    backend_is(monkeypatch, "NCCL")
    out, report = lowered(with_nccl_symm(tmp_path))
    (d,) = report.decisions
    assert d["chose"] == "nccl_symm" and d["variant"].startswith("copy-in: NCCL's all_reduce")
    assert d["predicted_exposed_us"] == {"nccl": pytest.approx(15.52, abs=0.01),
                                         "nccl_symm": pytest.approx(3.13, abs=0.01)}
    assert "backend is NCCL's" in d["ruled_out"]["one_shot"]
    assert "backend is NCCL's" in d["ruled_out"]["two_shot"]
    assert len(calls(out, NCCL_SYMM)) == 1 and not all_reduces(out) and not calls(out, ONE_SHOT)
    ((group, described),) = issue_sequence(out.graph)
    assert group == "0" and described.startswith("nccl_symm_all_reduce(0) -> bfloat16[16, 4096]")
    assert lowered_bytes([report]) == 16 * 4096 * 2  # prepared for, on the workspace


@pytest.mark.parametrize("backend", ["CUDA", None])
def test_nccl_symm_ruled_out_on_another_backend(tmp_path, monkeypatch, backend):
    backend_is(monkeypatch, backend)
    out, report = lowered(with_nccl_symm(tmp_path))
    (d,) = report.decisions
    assert d["chose"] == "one_shot" and not calls(out, NCCL_SYMM)
    assert d["ruled_out"]["nccl_symm"].startswith(
        f"this process's symmetric-memory backend is {backend or 'not set'}, not NCCL's")


def test_symm_problem_prepares_each_group_with_its_backend(monkeypatch):
    """A sequence running nccl_symm on group "a" and one-shot on "b" (two processes' worth:
    each prepares with its own module), each with the largest lowered size."""
    import torch.distributed as dist

    from fxcoalesce import lowering
    from fxcoalesce import lowering as rank_check
    from fxcoalesce.kernels import nccl_symm, symm

    seen = []
    monkeypatch.setattr(rank_check, "_resolve", lambda name: name)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(nccl_symm, "prepare",
                        lambda g, dev, n: (seen.append(("nccl_symm", g, n)), (True, "ok"))[1])
    monkeypatch.setattr(symm, "symm_mem_ready", lambda g: (True, "ok"))
    monkeypatch.setattr(symm, "prepare",
                        lambda g, dev, n: (seen.append(("symm", g, n)), (False, "no memory"))[1])
    sequence = [("a", "nccl_symm_all_reduce(a) -> bfloat16[8]"),
                ("c", "all_reduce(sum, c) -> bfloat16[8]")]
    assert lowering.symm_problem(sequence, 4096) is None
    assert seen == [("nccl_symm", "a", 4096)]
    sequence.append(("b", "one_shot_all_reduce(sum, b) -> bfloat16[8]"))
    assert lowering.symm_problem(sequence, 64) == (
        "group b: preparing symmetric memory failed: no memory")
    assert seen[1:] == [("nccl_symm", "a", 64), ("symm", "b", 64)]
