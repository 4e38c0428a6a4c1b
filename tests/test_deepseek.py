"""DeepSeek-V3 / Kimi-K2 model: routing, static MoE, KV cache, tensor parallelism, and the
all_reduce count of a full-size verify step traced under fake tensors."""

import contextlib
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from fxcoalesce.apps.launch import spawn
from fxcoalesce.apps.steps import make_step
from fxcoalesce.models import deepseek as ds
from fxcoalesce.models.eagle3 import Tree, tree_verify_inputs, verify_step

TINY = ds.CONFIGS["kimi-k2-tiny"]
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group: collectives trace but never run."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_configs():
    k2 = ds.CONFIGS["kimi-k2"]
    assert (k2.n_layers, k2.n_dense_layers, k2.dim, k2.n_heads) == (61, 1, 7168, 64)
    assert k2.vocab == 163840
    assert (k2.n_routed_experts, k2.n_shared_experts, k2.n_activated_experts) == (384, 1, 8)
    assert k2.capture_layers == (2, 30, 58)
    v3 = ds.CONFIGS["deepseek-v3"]
    assert (v3.n_dense_layers, v3.n_heads, v3.n_routed_experts) == (3, 128, 256)
    assert (v3.n_expert_groups, v3.n_limited_groups) == (8, 4)


@pytest.mark.parametrize("n_layers, layers", [
    (61, (2, 30, 58)), (7, (2, 3, 4)),  # EAGLE-3's (2, L // 2, L - 3)
    (6, (0, 3, 5)), (4, (0, 2, 3)), (3, (0, 1, 2)),  # it repeats a layer: first, middle, last
])
def test_default_capture_layers(n_layers, layers):
    assert replace(TINY, n_layers=n_layers, n_dense_layers=1).capture_layers == layers


@torch.no_grad()
@pytest.mark.parametrize("eagle_layers", [None, (3, 0, 2)])
def test_forward_returns_the_states_entering_the_capture_layers(eagle_layers):
    """Fails if forward captures a layer twice (the (2, L // 2, L - 3) rule alone gives
    (1, 2, 2) for the 4-layer tiny model), another layer than capture_layers (e.g. a layer's
    output instead of its input), or concatenates them in another order."""
    args = replace(TINY, eagle_layers=eagle_layers)
    assert args.capture_layers == (eagle_layers or (0, 2, 3))
    model = ds.build(args, dtype=torch.float64)
    model.setup_cache(1, 16)
    entering = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda mod, inputs, i=i: entering.update({i: inputs[0]}))
    pos = torch.arange(5)
    _, hidden = model(torch.tensor([[5, 17, 300, 2, 99]]), pos, pos, ds.causal_mask(pos, 16))
    assert torch.equal(hidden, torch.cat([entering[i] for i in args.capture_layers], -1))


@pytest.mark.parametrize("change, message", [
    (dict(n_activated_experts=9), "n_activated_experts"),
    (dict(n_expert_groups=3), "must divide n_routed_experts"),
    (dict(eagle_layers=(0, 1, 4)), "eagle_layers"),
    (dict(eagle_layers=(1, 1, 2)), "distinct"),
    (dict(n_layers=2), r"n_layers \(2\) must be >= 3"),
    (dict(n_dense_layers=5), "n_dense_layers"),
    (dict(qk_rope_head_dim=7), "even"),
])
def test_args_checks(change, message):
    with pytest.raises(ValueError, match=message):
        replace(TINY, **change)


def test_gate_group_limited_with_bias():
    """noaux_tc by hand: scores = sigmoid(logits), 4 groups of 2 experts, 2 groups allowed,
    top-3; selection uses score + bias, the weights the unbiased scores (x route_scale)."""
    args = replace(TINY, dim=8, n_routed_experts=8, n_expert_groups=4, n_limited_groups=2,
                   n_activated_experts=3, route_scale=2.0)
    gate = ds.Gate(args).double()
    with torch.no_grad():
        gate.weight.copy_(torch.eye(8))
        gate.bias.zero_()
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.4, 3.0, -2.0, 0.1, 0.2]], dtype=torch.float64)
    s = logits.sigmoid()[0]
    # group sums: g0 1.150, g1 1.221, g2 1.072, g3 1.075 -> groups 1 and 0; expert 4 (the best
    # single score, in group 2) is excluded
    weights, ids = gate(logits)
    assert ids.tolist() == [[0, 2, 3]]
    torch.testing.assert_close(weights[0], s[[0, 2, 3]] / s[[0, 2, 3]].sum() * 2.0)
    with torch.no_grad():
        gate.bias[1] = 1.0  # expert 1 now wins selection, but is weighted by its raw score
    weights, ids = gate(logits)
    assert ids.tolist() == [[1, 0, 2]]
    torch.testing.assert_close(weights[0], s[[1, 0, 2]] / s[[1, 0, 2]].sum() * 2.0)


def moe_reference(moe: ds.MoE, x: torch.Tensor) -> torch.Tensor:
    """The reference implementation's per-token loop over the chosen experts."""
    flat = x.flatten(0, 1)
    weights, ids = moe.gate(flat)
    out = moe.shared(flat)
    for t in range(flat.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            h = F.silu(moe.w1[e] @ flat[t]) * (moe.w3[e] @ flat[t])
            out[t] += w * (moe.w2[e] @ h)
    return out.view_as(x)


@pytest.mark.parametrize("hand_merged", [False, True])
@pytest.mark.parametrize("tokens", [3, 5])  # 3 x 2 < 8 experts: gathered; 5 x 2 >= 8: dense
def test_moe_matches_per_token_loop(tokens, hand_merged):
    model = ds.build(TINY, hand_merged=hand_merged, dtype=torch.float64)
    moe = model.layers[1].ffn
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, TINY.dim, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), moe_reference(moe, x))


@torch.no_grad()
def test_incremental_decode_matches_prefill():
    model = ds.build(TINY, dtype=torch.float64)
    model.setup_cache(1, 32)
    tokens = torch.tensor([[5, 17, 300, 2, 99, 41, 7]])
    pos = torch.arange(7)
    full, hidden = model(tokens, pos, pos, ds.causal_mask(pos, 32))
    assert full.shape == (1, 7, TINY.vocab) and hidden.shape == (1, 7, 3 * TINY.dim)
    model.setup_cache(1, 32)
    first, _ = model(tokens[:, :4], pos[:4], pos[:4], ds.causal_mask(pos[:4], 32))
    steps = [first]
    for i in range(4, 7):
        p = pos[i : i + 1]
        steps.append(model(tokens[:, i : i + 1], p, p, ds.causal_mask(p, 32))[0])
    torch.testing.assert_close(torch.cat(steps, 1), full)


def test_forward_needs_cache():
    model = ds.build(TINY)
    pos = torch.arange(2)
    with pytest.raises(RuntimeError, match="setup_cache"):
        model(torch.tensor([[1, 2]]), pos, pos, ds.causal_mask(pos, 8))


def test_apply_tp_rejects_uneven_split():
    with fake_world(3) as group:
        model = ds.build(TINY)
        with pytest.raises(ValueError, match=r"n_heads.*choose a TP degree that divides 8"):
            ds.apply_tp(model, group)
        assert model.layers[0].attn.wo.weight.shape == (TINY.dim, TINY.n_heads * TINY.v_head_dim)
    with fake_world(2) as group:
        model = ds.build(replace(TINY, n_routed_experts=7))
        with pytest.raises(ValueError, match=r"routed experts.*divides 7"):
            ds.apply_tp(model, group)
        assert model.layers[1].ffn.w1.shape[0] == 7  # nothing was sharded


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tiny_shards_at_2_4_8(world):
    with fake_world(world) as group:
        model = ds.apply_tp(ds.build(TINY), group)
    assert model.layers[0].attn.n_local_heads == TINY.n_heads // world
    assert model.layers[1].ffn.w1.shape[0] == TINY.n_routed_experts // world
    assert model.layers[1].ffn.expert_start == 0  # rank 0


def test_apply_tp_none_is_noop():
    model = ds.build(TINY)
    assert ds.apply_tp(model, None) is model and model.head.weight.shape == (TINY.vocab, TINY.dim)


def trace_verify(args, world: int, hand_merged: bool):
    """Build ``args`` and 3 tree tokens under FakeTensorMode, shard at ``world``, trace
    verify_step to ATen; returns (all_reduces, all_gathers, logits, hidden, build_s, trace_s)."""
    torch._dynamo.reset()
    counts = {}

    def count(gm, example_inputs):
        targets = [n.target for n in gm.graph.nodes]
        counts.update(ar=targets.count(ALL_REDUCE), ag=targets.count(ALL_GATHER))
        return gm

    with fake_world(world) as group:
        start = time.perf_counter()
        with FakeTensorMode() as mode:
            model = ds.build(args, hand_merged=hand_merged, dtype=torch.bfloat16)
            ds.apply_tp(model, group)
            model.setup_cache(1, 4096)
            tree = Tree.from_parents(torch.tensor([11, 12, 13]), [-1, 0, 1])
            input_pos, cache_pos, mask = tree_verify_inputs(tree, 100, 4096)
        built = time.perf_counter()
        compiled = torch.compile(verify_step, backend=aot_autograd(fw_compiler=count),
                                 fullgraph=True)
        with mode, torch.no_grad():
            logits, hidden = compiled(model, tree.tokens[None], input_pos, cache_pos, mask)
        traced = time.perf_counter()
    torch._dynamo.reset()
    return counts["ar"], counts["ag"], logits, hidden, built - start, traced - built


def expected_all_reduces(args, hand_merged: bool) -> int:
    moe_layers = args.n_layers - args.n_dense_layers
    return 1 + args.n_layers + args.n_dense_layers + (1 if hand_merged else 2) * moe_layers


@pytest.mark.parametrize("hand_merged", [False, True])
@pytest.mark.parametrize("name", ["kimi-k2", "deepseek-v3"])
def test_full_width_few_layers_all_reduce_count(name, hand_merged):
    """Full widths (384 / 256 experts, TP 8) with 5 layers: fast."""
    args = replace(ds.CONFIGS[name], n_layers=5)
    ar, ag, logits, hidden, _, _ = trace_verify(args, 8, hand_merged)
    assert ar == expected_all_reduces(args, hand_merged)
    assert ag == 1  # the column-parallel head
    assert logits.shape == (1, 3, args.vocab) and hidden.shape == (1, 3, 3 * args.dim)


@pytest.mark.parametrize("step", ["forward", "verify"])
def test_make_step(step):
    """The CLI's entry: a tree (or causal) step over 7 tokens returns the logits."""
    model = ds.build(TINY, dtype=torch.float64)
    fn, args = make_step(model, step, 7)
    tokens, input_pos, cache_pos, mask = args
    want_pos = [64, 65, 65, 66, 66, 66, 66] if step == "verify" else list(range(7))
    assert input_pos.tolist() == want_pos and mask.shape == (1, 1, 7, 71)
    with torch.no_grad():
        assert torch.equal(fn(*args), model(*args)[0])
    with pytest.raises(ValueError, match="unknown step 'decode'"):
        make_step(model, "decode", 1)


def test_kimi_k2_builds_and_shards_under_fake_mode():
    with fake_world(8) as group, FakeTensorMode():
        model = ds.build("kimi-k2", dtype=torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) > 1.0e12
        ds.apply_tp(model, group)
        assert model.layers[1].ffn.w1.shape == (48, 2048, 7168)
        assert model.layers[0].attn.wq_b.weight.shape == (8 * 192, 1536)
        assert model.layers[0].ffn.w1.weight.shape == (18432 // 8, 7168)
        assert model.embed.weight.shape == (163840 // 8, 7168)


@pytest.mark.slow
@pytest.mark.parametrize("hand_merged, expected", [(False, 183), (True, 123)])
def test_kimi_k2_full_verify_all_reduce_count(hand_merged, expected):
    """All 61 layers at TP 8: 1 + 61 + 1 + 2 x 60 = 183 all_reduces (123 hand-merged)."""
    ar, ag, logits, _, build_s, trace_s = trace_verify(ds.CONFIGS["kimi-k2"], 8, hand_merged)
    print(f"kimi-k2 TP8 hand_merged={hand_merged}: build+shard {build_s:.1f} s, "
          f"trace {trace_s:.1f} s")
    assert (ar, ag) == (expected, 1)
    assert logits.shape == (1, 3, 163840)  # the times are printed, not asserted: a shared
    # 2-core machine running other slow files took past any bound that still means something


def _tp2_logits_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    tokens = torch.tensor([[3, 14, 159, 26, 5, 35]])
    pos = torch.arange(6)
    mask = ds.causal_mask(pos, 16)
    results = {}
    with torch.no_grad():
        for hand_merged in (False, True):
            model = ds.build(TINY, hand_merged=hand_merged, dtype=torch.float64)
            model.setup_cache(1, 16)
            results["tp1"] = model(tokens, pos, pos, mask)
            ds.apply_tp(model, dist.group.WORLD)
            model.setup_cache(1, 16)
            results[f"tp2_{hand_merged}"] = model(tokens, pos, pos, mask)
    return results


def test_tp2_gloo_matches_unsharded():
    ranks = spawn(_tp2_logits_worker, 2, backend="gloo")
    for r in ranks:
        for key in ("tp2_False", "tp2_True"):
            for got, want in zip(r[key], r["tp1"]):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for got, want in zip(ranks[0]["tp2_False"], ranks[1]["tp2_False"]):
        assert torch.equal(got, want)
