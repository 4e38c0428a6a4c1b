"""Tier 3: real gloo ranks on CPU. The graph rewritten by the pass computes what the
unrewritten graph computes, and every rank runs the same collectives in the same order."""

import pytest
import torch
import torch.distributed as dist

import fxcoalesce
from fxcoalesce.torch_releases import COMM_REORDER_RIGHT_FROM, comm_reorder_options, torch_version
from fxcoalesce.apps.launch import spawn


def _compare(rank, world, name, codegen):
    from fxcoalesce import models

    torch.set_num_threads(1)
    graphs = []
    outs = []
    tokens = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(0))
    for passes in ((), ("bucket", "schedule")):
        model = models.apply_tp(models.build(name), dist.group.WORLD)
        be = fxcoalesce.backend(fxcoalesce.Config(passes=passes, codegen=codegen, strict=True),
                                on_graph=lambda b, a, r: graphs.append((a, r)))
        with torch.no_grad():
            outs.append(torch.compile(model, backend=be, fullgraph=True)(tokens))
    after, report = graphs[-1]
    return {"without": outs[0], "with": outs[1], "report": report.to_json(),
            "launches": report.all_reduce["after"],
            "collectives": collective_order(after)}


def collective_order(gm):
    """The collectives in issue order, with their arguments and sizes (rank constants such
    as the embedding's shard offset legitimately differ, so whole graphs are not compared)."""
    return [(str(n.target), n.args[1:], tuple(n.meta["val"].shape)) for n in gm.graph.nodes
            if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pass_preserves_outputs(world):
    res = spawn(_compare, world, ("neox-tiny", "eager"), backend="gloo")
    for r in res:
        if world == 2:  # two-rank sums are order-free: bucketing must be bit-exact
            assert torch.equal(r["with"], r["without"])
        else:  # gloo may pick another algorithm for the larger fused buffer
            torch.testing.assert_close(r["with"], r["without"])
        assert r["launches"] == 5
    assert all(r["collectives"] == res[0]["collectives"] for r in res)  # same order
    torch.testing.assert_close(res[0]["with"], res[-1]["with"], rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_two_ranks_bit_exact():
    res = spawn(_compare, 2, ("neox-tiny", "inductor"), backend="gloo")
    for r in res:
        assert torch.equal(r["with"], r["without"])
    assert all(r["collectives"] == res[0]["collectives"] for r in res)


def _two_lengths(rank, world):
    """neox-tiny with 2 of its 4 layers (the fusion is per layer; all 4 took 30-40 s on 2
    loaded cores), each length without and with the passes."""
    from fxcoalesce import models

    torch.set_num_threads(1)
    outs, reports = {}, []
    for passes in ((), ("bucket", "schedule")):
        torch._dynamo.reset()
        model = models.apply_tp(models.build("neox-tiny", layers=2), dist.group.WORLD)
        be = fxcoalesce.backend(fxcoalesce.Config(passes=passes, codegen="eager", strict=True),
                                on_graph=lambda b, a, r: reports.append(r))
        step = torch.compile(model, backend=be, fullgraph=True)
        with torch.no_grad():
            for n in (5, 8):  # the second length recompiles with symbolic sizes
                tokens = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(n))
                outs[passes, n] = step(tokens)
    return {"outs": outs, "after": [r.all_reduce["after"] for r in reports]}


def test_symbolic_sizes_on_real_ranks_bit_exact():
    res = spawn(_two_lengths, 2, (), backend="gloo")
    for r in res:
        # without the pass: 5 launches per graph; with it: 3, static and symbolic alike
        assert r["after"] == [5, 5, 3, 3]
        for n in (5, 8):
            assert torch.equal(r["outs"][(), n], r["outs"][("bucket", "schedule"), n])


def _against_eager(rank, world, options, inductor_options=None):
    """kimi-k2-tiny's verify step as the demo compiles it (the module an argument; KV cache
    written and read in the step, MoE, the head's all_gather), through fxcoalesce with
    ``options``, against eager on the same inputs."""
    from fxcoalesce.models import apply_tp, build, eagle3
    from fxcoalesce.models.deepseek import causal_mask

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = apply_tp(build("kimi-k2-tiny"), dist.group.WORLD)
    model.setup_cache(1, 64)
    tokens = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(8)
    args = (model, tokens, pos, pos, causal_mask(pos, 64))
    with torch.no_grad():
        want = eagle3.verify_step(*args)[0].clone()
        torch._dynamo.reset()
        got = torch.compile(eagle3.verify_step, fullgraph=True, backend=fxcoalesce.backend(
            fxcoalesce.Config(**options), options=inductor_options))(*args)[0]
    return float((got - want).abs().max())


@pytest.mark.parametrize("options", [{}, pytest.param({"reassociate": False},
                                                     marks=pytest.mark.slow)])
def test_compiled_verify_matches_eager(options):
    """Regression: the backend once turned on Inductor's sink_waits/raise_comms passes; the
    logits were off by ~2 (the KV cache writes ran out of order), and fxcoalesce, compared
    only against itself, did not notice."""
    for err in spawn(_against_eager, 2, (options,), backend="gloo"):
        assert err < 1e-4


@pytest.mark.skipif(torch_version() < COMM_REORDER_RIGHT_FROM,
                    reason="the passes stay off before torch 2.14 (test below)")
@pytest.mark.parametrize("passes", [["raise_comms"],
                                    pytest.param(["sink_waits"], marks=pytest.mark.slow)])
def test_inductor_comm_reorder_passes_right_from_2_14(passes):
    """Inductor's raise_comms and sink_waits scheduler passes, which the backend runs after its
    passes from torch 2.14 on (``torch_releases.comm_reorder_options``), keep the KV-cache
    writes of kimi-k2-tiny's verify step in order. Before 2.14 they ran a write after the read
    that needed it (logits off by 2.31, measured on 2.13.0 with Inductor's peak-memory
    reordering on); right on 2.14.1 and 2.15.0."""
    overlap = {"reorder_for_compute_comm_overlap": True,
               "reorder_for_compute_comm_overlap_passes": passes,
               # compiled here, never served from a cache an earlier test filled without them
               "fx_graph_cache": False}
    # without the run-time tags, as the passes were first measured (their checks once turned
    # off Inductor's peak-memory reordering; torch_releases.keep_mutation_renames made that moot)
    errs = spawn(_against_eager, 2, ({"run_checks": False}, overlap), backend="gloo")
    assert max(errs) < 1e-4


def test_comm_reorder_passes_off_before_2_14():
    """Before torch 2.14 the backend leaves Inductor's comm reordering passes off. The wrong
    logits they gave on 2.13.0 (2.31 off) are not asserted here: twice in the whole suite on
    CI the same compile came back right (4.6e-6, the value with either reordering off), so a
    canary of the upstream bug failed at random; benchmarks/NOTES.md has the measurements."""
    import torch._inductor.config as inductor_config

    if torch_version() >= COMM_REORDER_RIGHT_FROM:
        assert comm_reorder_options()["reorder_for_compute_comm_overlap_passes"]
    else:
        assert comm_reorder_options() == {}
        assert inductor_config.reorder_for_compute_comm_overlap is False

