"""The fixed-shape EAGLE-3 step (models.eagle3_static) against models.eagle3: the same trees,
the same tokens and accepted lengths, one graph with no break (no host sync) per step."""

import pytest
import torch
from test_eagle3 import PROMPT, SMALL_VOCAB, hinted_draft, make_pair
from test_eagle3_draft import DEPTH, TINY, TOP_K, TOTAL, make_draft
from test_eagle3_draft import PROMPT as LONG_PROMPT

import fxcoalesce
from fxcoalesce.models import deepseek as ds
from fxcoalesce.models import eagle3 as e3
from fxcoalesce.models import eagle3_static as es
from fxcoalesce.torch_releases import locality_reorder_unsafe

SPEC = es.TreeSpec(top_k=TOP_K, depth=DEPTH, total_tokens=TOTAL)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def assert_same_tree(got: e3.Tree, want: e3.Tree) -> None:
    for name in ("tokens", "parents", "depth", "mask", "retrieve_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("shape", [(8192,), (8, 8192), (3, 1000), (64,), (5,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_rows_is_topk(shape, dtype):
    """The same values as ``topk``, descending, and indices that hold them; bfloat16 (few
    values) has ties across chunks; (3, 1000) and (64,) take the one-sort path."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    k = min(8, shape[-1])
    want = x.topk(k)
    values, ids = es.topk_rows(x, k)
    assert torch.equal(values, want.values) and ids.dtype == want.indices.dtype
    assert torch.equal(x.gather(-1, ids), values)
    assert all(len(set(row)) == k for row in ids.reshape(-1, k).tolist())


def test_static_tree_equals_draft_tree():
    """After an eager catch-up on the first pairs, one real pair (as after a prefill), then
    three real pairs padded to depth + 1 (as after a verify that accepted two tokens): the
    trees of eagle3.draft_tree, node for node. Each drafter has its own cache, both reused."""
    target = ds.build(TINY, dtype=torch.float64)
    target.setup_cache(1, 32)
    logits, hidden = e3.prefill(target, LONG_PROMPT)  # 10 tokens
    pairs = torch.cat([LONG_PROMPT[1:], logits[-1:].argmax(-1)])
    ref, _ = make_draft()
    fast, _ = make_draft()
    ref.setup_cache(64)
    fast.setup_cache(64)
    pos = torch.arange(6)
    fast(pairs[None, :6], fast.fc(hidden[None, :6]), pos, pos, e3.visible_mask(
        0, torch.ones(6, 6, dtype=torch.bool).tril(), 64))
    M = SPEC.pairs
    for start, stop in ((0, 7), (7, 10)):
        want = e3.draft_tree(ref, pairs[start:stop], hidden[start:stop], stop, top_k=TOP_K,
                             depth=DEPTH, total_tokens=TOTAL)
        first = max(start, 6)
        n = stop - first
        tokens = torch.cat([pairs[first:stop], torch.zeros(M - n, dtype=torch.long)])
        feats = torch.cat([hidden[first:stop], torch.zeros(M - n, hidden.shape[1])])
        got = es.draft_tree_static(fast, tokens, feats, torch.tensor(n), torch.tensor(stop), SPEC)
        assert_same_tree(es.to_tree(*got), want)


def _spec_pair():
    target, draft = make_pair(SMALL_VOCAB)
    seq = torch.cat([PROMPT, e3.greedy_generate(target, PROMPT, 48)])
    draft = hinted_draft(draft, seq)
    draft.setup_cache(128 + SPEC.draft_slots())
    return target, draft, seq


def _counting(fn, calls: list):
    def call(*args):
        calls.append(fn)
        return fn(*args)
    return call


@pytest.mark.parametrize("ahead", [False, True])
def test_static_generation_equals_reference(ahead):
    """Tokens and accepted lengths of eagle3.speculative_generate (itself checked against
    the target's greedy decoding and the longest right path): both long and short paths.
    ``ahead``: the same, each step launched before the last is read, one step past the end."""
    target, draft, seq = _spec_pair()
    want, want_stats = e3.speculative_generate(target, draft, PROMPT, 40, top_k=TOP_K,
                                               depth=DEPTH, total_tokens=TOTAL)
    draft.setup_cache(128 + SPEC.draft_slots())
    calls = []
    got, stats = es.speculative_generate_static(target, draft, PROMPT, 40, spec=SPEC,
                                                step_fn=_counting(es.spec_step, calls),
                                                ahead=ahead)
    assert got == want.tolist() == seq[len(PROMPT): len(PROMPT) + 40].tolist()
    assert stats.accepted == want_stats.accepted
    assert max(stats.accepted) >= 4 and min(stats.accepted) < 4, stats.accepted
    assert len(calls) == len(stats.accepted) + ahead
    calls = []
    assert es.greedy_generate_static(target, PROMPT, 40, ahead=ahead,
                                     step_fn=_counting(es.decode_step, calls)) == want.tolist()
    assert len(calls) == 39 + ahead


@pytest.mark.parametrize("ahead", [False, True])
def test_static_generation_stops_at_a_stop_token(ahead):
    target, draft, seq = _spec_pair()
    new = seq[len(PROMPT):].tolist()
    stop = new[17]
    want = new[: new.index(stop) + 1]
    got, _ = es.speculative_generate_static(target, draft, PROMPT, 40, spec=SPEC,
                                            stop_tokens={stop}, ahead=ahead)
    assert got == want
    assert es.greedy_generate_static(target, PROMPT, 40, stop_tokens={stop},
                                     ahead=ahead) == want
    ref, _ = e3.speculative_generate(target, draft, PROMPT, 40, top_k=TOP_K, depth=DEPTH,
                                     total_tokens=TOTAL, stop_tokens={stop})
    assert ref.tolist() == want


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("after", [1, 3])
def test_greedy_takes_over_from_the_same_cache(after, ahead):
    """``give_up`` True after a step: greedy decoding continues from the speculative
    decoding's cache and newest token, to the same tokens; the steps before it are kept."""
    target, draft, seq = _spec_pair()
    asked = []

    def give_up(steps, tokens):
        asked.append((steps, tokens))
        return steps == after

    calls = []

    def greedy_fn(model, state):
        calls.append(int(state[1]))
        return es.decode_step(model, state)

    got, stats = es.speculative_generate_static(target, draft, PROMPT, 40, spec=SPEC,
                                                give_up=give_up, greedy_fn=greedy_fn,
                                                ahead=ahead)
    assert got == seq[len(PROMPT): len(PROMPT) + 40].tolist()
    assert stats.greedy_from == after and len(stats.accepted) == after
    emitted = 1 + sum(stats.accepted)  # the prefill's token, then the steps'
    assert asked[-1] == (after, emitted)
    # greedy's first position is the speculative decoding's committed length: prompt + emitted - 1
    # (the spec step launched ahead ran past the handover, its writes overwritten by greedy's)
    assert calls[0] == len(PROMPT) + emitted - 1 and len(calls) == 40 - emitted + ahead
    _, never = es.speculative_generate_static(target, draft, PROMPT, 40, spec=SPEC,
                                              give_up=lambda s, t: False)
    assert never.greedy_from is None


def test_compiled_steps_are_one_graph_each():
    """fullgraph=True fails on any graph break, e.g. a host read inside the step; a fixed
    shape compiles once for all steps."""
    torch._dynamo.reset()
    target, draft, seq = _spec_pair()
    graphs = []
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager", strict=True),
                            on_graph=lambda before, after, report: graphs.append(report))
    step = torch.compile(es.spec_step, backend=be, fullgraph=True)
    got, stats = es.speculative_generate_static(target, draft, PROMPT, 40, spec=SPEC,
                                                step_fn=step)
    assert got == seq[len(PROMPT): len(PROMPT) + 40].tolist() and len(stats.accepted) > 2
    assert len(graphs) == 1
    decode = torch.compile(es.decode_step, backend=be, fullgraph=True)
    assert es.greedy_generate_static(target, PROMPT, 20, step_fn=decode) == got[:20]
    assert len(graphs) == 2
    torch._dynamo.reset()


def test_compiled_prefill_is_one_graph_and_the_same_tokens():
    """The prompt padded to 64 tokens, prefilled in one graph (the target's, then the draft's
    pairs): the same tokens and accepted lengths as the eager prefill's (float32); the pad
    rows' cache slots are written again before any query sees them. A second prompt of
    another length replays the same graph."""
    torch._dynamo.reset()
    target, draft, seq = _spec_pair()
    want, want_stats = es.speculative_generate_static(target, draft, PROMPT, 40, spec=SPEC)
    graphs = []
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager", strict=True),
                            on_graph=lambda before, after, report: graphs.append(report))

    def spec_prefill(target, draft, tokens, P):
        return es.spec_prefill_static(target, draft, tokens, P, SPEC.pairs)

    def prefilled(**kw):  # the caches' prompt slots after the prefill alone (no step)
        for c in e3.kv_caches(target) + e3.kv_caches(draft):
            c.zero_()
        es.speculative_generate_static(target, draft, PROMPT, 1, spec=SPEC, **kw)
        P = len(PROMPT)  # the draft holds the pairs (x_{j+1}, h_j), j < P - 1
        return ([c[:, :P].clone() for c in e3.kv_caches(target)]
                + [c[:, :P - 1].clone() for c in e3.kv_caches(draft)])

    for a, b in zip(prefilled(), prefilled(prefill_fn=spec_prefill), strict=True):
        torch.testing.assert_close(a, b)
    compiled = torch.compile(spec_prefill, backend=be, fullgraph=True, dynamic=False)
    for prefill in (spec_prefill, compiled):
        got, stats = es.speculative_generate_static(target, draft, PROMPT, 40, spec=SPEC,
                                                    prefill_fn=prefill)
        assert got == want and stats.accepted == want_stats.accepted
    greedy_prefill = torch.compile(es.prefill_static, backend=be, fullgraph=True,
                                   dynamic=False)
    assert es.greedy_generate_static(target, PROMPT, 40, prefill_fn=greedy_prefill) == want
    shorter = PROMPT[:-2]
    assert (es.greedy_generate_static(target, shorter, 20, prefill_fn=greedy_prefill)
            == es.greedy_generate_static(target, shorter, 20))
    assert len(graphs) == 2  # one per prefill, both prompt lengths
    torch._dynamo.reset()


def test_room_checks():
    target, draft, _ = _spec_pair()
    with pytest.raises(ValueError, match="exceed the target KV cache"):
        es.speculative_generate_static(target, draft, PROMPT, 110, spec=SPEC)
    T = es.kv_caches(target)[0].shape[1]
    fits = T - len(PROMPT) - SPEC.total_tokens  # without the step launched past the end
    with pytest.raises(ValueError, match=f"\\+ {SPEC.total_tokens + SPEC.pairs} slots"):
        es.speculative_generate_static(target, draft, PROMPT, fits, spec=SPEC, ahead=True)
    draft.setup_cache(128)
    with pytest.raises(ValueError, match="draft KV cache"):
        es.speculative_generate_static(target, draft, PROMPT, 10, spec=SPEC)


@pytest.mark.slow  # two Inductor compiles (mode="reduce-overhead"): 1.5-7 min on 2 cores
def test_compiled_steps_are_cuda_graph_ready(monkeypatch):
    """What would make Inductor skip CUDA graphs for the steps, checked on CPU (where the CPU
    device itself is the reason given): an op CUDA graphs cannot hold, or an input mutated
    in place that is not a parameter or buffer (the KV caches must be module buffers). Both
    steps and both prefills go through the fxcoalesce backend with mode="reduce-overhead" and
    Inductor, as the GPU benchmark compiles them."""
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config
    import torch._inductor.cudagraph_utils as cudagraph_utils

    from fxcoalesce.models import llama

    names = ("check_for_mutation_ignore_cuda_graph_managed_tensor",
             "check_lowering_disable_cudagraph")
    if not all(hasattr(cudagraph_utils, n) for n in names) or not hasattr(
            compile_fx, "get_first_incompatible_cudagraph_node"):
        pytest.skip("this torch's Inductor checks CUDA-graph safety elsewhere")
    mutations, incompatible = [], []
    check_mutation = cudagraph_utils.check_for_mutation_ignore_cuda_graph_managed_tensor
    check_ops = compile_fx.get_first_incompatible_cudagraph_node

    def spy_mutation(*args):
        mutations.append(check_mutation(*args))
        return "test: CUDA graphs stay off on CPU"

    monkeypatch.setattr(cudagraph_utils, names[0], spy_mutation)
    monkeypatch.setattr(cudagraph_utils, names[1], lambda mapping: None)  # the CPU device
    monkeypatch.setattr(compile_fx, "get_first_incompatible_cudagraph_node",
                        lambda gm: incompatible.append(check_ops(gm)) or incompatible[-1])
    torch._dynamo.reset()
    target = llama.build(llama.TINY)
    spec = es.TreeSpec(top_k=4, depth=3, total_tokens=12)
    target.setup_cache(1, 128)
    draft = e3.build_draft(e3.DraftArgs.for_target(target.args, draft_vocab=64),
                           d2t=torch.full((64,), 5), seed=1)
    draft.setup_cache(128 + spec.draft_slots())
    be = fxcoalesce.backend(fxcoalesce.Config(), mode="reduce-overhead")
    prompt = torch.arange(3, 20)
    with inductor_config.patch({"triton.cudagraph_support_input_mutation": False,
                                "graph_partition": False}):
        step = torch.compile(es.spec_step, backend=be, fullgraph=True)
        spec_prefill = torch.compile(
            lambda t, d, tokens, P: es.spec_prefill_static(t, d, tokens, P, spec.pairs),
            backend=be, fullgraph=True, dynamic=False)
        got, _ = es.speculative_generate_static(target, draft, prompt, 12, spec=spec,
                                                step_fn=step, prefill_fn=spec_prefill)
        decode = torch.compile(es.decode_step, backend=be, fullgraph=True)
        prefill = torch.compile(es.prefill_static, backend=be, fullgraph=True, dynamic=False)
        want = es.greedy_generate_static(target, prompt, 12, step_fn=decode, prefill_fn=prefill)
    torch._dynamo.reset()
    assert got == want
    assert mutations == [None] * 4  # every graph ran the check; every mutation is a buffer
    assert incompatible == [None] * 4


def _tp2_inductor_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from fxcoalesce.models import llama

    torch.set_num_threads(1)
    target = llama.build(llama.TINY)
    spec = es.TreeSpec(top_k=4, depth=4, total_tokens=16)
    prompt = torch.arange(3, 20)
    target.setup_cache(1, 128)
    seq = torch.cat([prompt, e3.greedy_generate(target, prompt, 60)])

    class Hinted(e3.Eagle3Draft):
        def forward(self, tokens, *rest):
            logits, hidden = super().forward(tokens, *rest)
            return logits + 20 * F.one_hot(self.hint[tokens], logits.shape[-1]), hidden

    args = e3.DraftArgs.for_target(target.args)
    draft = Hinted(args)
    draft.load_state_dict(e3.build_draft(args, seed=1).state_dict())
    hint = torch.zeros(args.target_vocab, dtype=torch.long)
    hint[seq[:-1]] = seq[1:]
    draft.register_buffer("hint", hint)
    llama.apply_tp(target, dist.group.WORLD)
    target.setup_cache(1, 128)
    draft.setup_cache(128 + spec.draft_slots())
    step = torch.compile(es.spec_step, fullgraph=True, backend=fxcoalesce.backend(
        fxcoalesce.Config()))
    got, stats = es.speculative_generate_static(target, draft, prompt, 40, spec=spec,
                                                step_fn=step)
    return dict(got=got, want=seq[len(prompt): len(prompt) + 40].tolist(),
                accepted=stats.accepted)


@pytest.mark.slow
def test_compiled_step_tp2_inductor():
    """The speculative step compiled by Inductor over 2 gloo ranks decodes the target's greedy
    tokens, accepting long paths. (With Inductor's sink_waits pass on, which the backend once
    turned on, the generated code read the last all_reduce's buffer before waiting for it:
    benchmarks/NOTES.md, tests/test_ranks.py tracks the upstream bug.)"""
    from fxcoalesce.apps.launch import spawn

    for r in spawn(_tp2_inductor_worker, 2, (), backend="gloo"):
        assert r["got"] == r["want"] and max(r["accepted"]) >= 4, r


def _tp2_hidden_worker(rank: int, world: int, fxc: bool) -> float:
    import dataclasses

    import torch.distributed as dist

    from fxcoalesce.models import llama

    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = llama.build(dataclasses.replace(llama.TINY, n_layers=12))
    draft = e3.build_draft(e3.DraftArgs.for_target(target.args), seed=1)
    llama.apply_tp(target, dist.group.WORLD)
    spec = es.TreeSpec(top_k=2, depth=2, total_tokens=4)
    target.setup_cache(1, 128)
    draft.setup_cache(128 + spec.draft_slots())
    caches = e3.kv_caches(target) + e3.kv_caches(draft)
    be = fxcoalesce.backend(fxcoalesce.Config()) if fxc else "inductor"
    with torch.no_grad():
        state, pairs = es.spec_prefill_static(target, draft, *es.pad_prompt(torch.arange(3, 20)),
                                              spec.pairs)
        before = [c.clone() for c in caches]
        want_state, want_hidden = es.spec_step(target, draft, state, pairs, spec)
        for c, b in zip(caches, before):
            c.copy_(b)
        got_state, got_hidden = torch.compile(es.spec_step, backend=be, fullgraph=True)(
            target, draft, state, pairs, spec)
    assert torch.equal(got_state, want_state)
    return float((got_hidden - want_hidden).abs().max())


@pytest.mark.slow  # an Inductor compile of a 12-layer step on 2 gloo ranks: ~1 min on 2 cores
@pytest.mark.parametrize("fxc", [
    True,
    pytest.param(False, marks=pytest.mark.xfail(
        locality_reorder_unsafe(), strict=True,
        reason="torch < 2.15: Inductor's CPU fusion drops mutation renames (torch_releases)")),
], ids=["fxcoalesce", "plain"])
def test_compiled_step_tp2_hidden_matches_eager(fxc):
    """The speculative step compiled by Inductor over 2 gloo ranks returns the eager step's
    hidden states (the draft's next input), not only its tokens. Before torch 2.15 Inductor's
    CPU backend, fusing, lost the edge from a read of an all_reduce's result to the in-place
    all_reduce, and its peak-memory reordering then ran the read first: plain
    ``backend="inductor"`` computes them wrong there (an expected failure, strict: a torch
    that fixes it fails this test, and ``torch_releases.LOCALITY_REORDER_RIGHT_FROM`` moves);
    fxcoalesce's backend keeps the edge (``torch_releases.keep_mutation_renames``)."""
    from fxcoalesce.apps.launch import spawn

    assert max(spawn(_tp2_hidden_worker, 2, (fxc,), backend="gloo")) < 1e-4
