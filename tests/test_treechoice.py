"""The speculative tree sized from measurement (apps/spec/treechoice.py): the choice as a pure
function of measured step times and accepted lengths, the decoder's walk it predicts from,
and the decision on the real SmolLM2-135M with its head (timed here, cached, forced)."""

import json
from pathlib import Path

import pytest
import torch

from fxcoalesce.apps.spec import treechoice as tc

HEAD = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m"
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# --- the choice, a pure function -------------------------------------------------------------

def test_choose_takes_the_argmax_of_tokens_per_second():
    step = {"1,1,2": 0.10, "1,3,4": 0.14, "8,6,64": 0.80}
    acc = {"1,1,2": 1.6, "1,3,4": 2.4, "8,6,64": 3.5}
    c = tc.choose(0.08, step, acc)  # greedy 12.5 tok/s; rates 16, 17.1, 4.4
    assert c.shape == (1, 3, 4)
    assert c.rates["1,3,4"] == pytest.approx(2.4 / 0.14, abs=0.01)
    assert c.rates["greedy"] == pytest.approx(12.5)
    assert c.spec.total_tokens == 4 and c.spec.depth == 3
    assert "(1,3,4)" in c.reason and "1.37x" in c.reason


def test_choose_picks_greedy_when_no_tree_beats_it():
    step = {"1,1,2": 0.15, "2,3,8": 0.30}
    acc = {"1,1,2": 1.44, "2,3,8": 1.9}
    c = tc.choose(0.10, step, acc)  # greedy 10 tok/s; trees 9.6, 6.3
    assert c.shape is None and c.spec is None
    assert c.reason.startswith("greedy: no tree beats it") and "(1,1,2)" in c.reason
    assert c.label() == "none (greedy decoding)"
    # forced: the best tree all the same, and the reason says greedy was predicted faster
    forced = tc.choose(0.10, step, acc, force_spec=True)
    assert forced.shape == (1, 1, 2) and "greedy predicted faster" in forced.reason


def test_choose_needs_the_margin():
    step, acc = {"1,1,2": 0.10}, {"1,1,2": 1.03}  # 10.3 tok/s against greedy's 10
    assert tc.choose(0.10, step, acc).shape is None  # within the 5% margin: greedy
    assert tc.choose(0.10, step, acc, margin=1.0).shape == (1, 1, 2)


def test_choose_skips_candidates_without_an_acceptance_and_refuses_none():
    c = tc.choose(0.2, {"1,1,2": 0.1, "4,4,16": 0.1}, {"1,1,2": 1.5})
    assert c.shape == (1, 1, 2) and "4,4,16" not in c.rates
    with pytest.raises(ValueError, match="at least one candidate"):
        tc.choose(0.2, {"1,1,2": 0.1}, {})


@pytest.mark.parametrize("text, want", [("auto", "auto"), ("greedy", "greedy"),
                                        ("4,4,16", (4, 4, 16)), ("1,1,2", (1, 1, 2))])
def test_parse_tree(text, want):
    assert tc.parse_tree(text) == want


@pytest.mark.parametrize("text, match", [("4,4", "expected K,D,N"), ("fast", "expected"),
                                         ("1,2,9", "total_tokens")])
def test_parse_tree_refuses(text, match):
    with pytest.raises(ValueError, match=match):
        tc.parse_tree(text)


def test_demo_lines_say_greedy_was_chosen_and_why():
    from fxcoalesce.apps.demo import spec_lines

    reason = tc.choose(0.10, {"1,1,2": 0.15}, {"1,1,2": 1.44}).reason
    summary = {"all_reduce_per_call": {"decode": {"before": 61, "after": 61,
                                                  "lower_bound": 61}},
               "verdict": {"decode": "already at its bound"}, "pass_ms": {},
               "mean_accepted": 1.0, "tokens_per_s": {"speculative": 9.0, "target_greedy": 9.0},
               "speedup_vs_target_greedy": 1.0, "ranks_agree": True, "settings": {},
               "tree_choice": {"label": "none (greedy decoding)", "reason": reason,
                               "greedy_chosen": True, "source": "measured"}}
    lines = [ln.strip() for ln in spec_lines(summary, {"spec_tokens": 8, "same_tokens": True},
                                             2, stopped=False)]
    assert lines[0] == "tree                             : none (greedy decoding) (measured)"
    assert lines[1].endswith(reason) and "0.96x" in lines[1]
    assert lines[2].startswith("all_reduce per greedy decode step: 61 -> 61")
    assert not any("accepted length" in x for x in lines)
    assert any(x.startswith("tokens per second                : 9.0 greedy") for x in lines)


# --- the walk and the decision on the real model ----------------------------------------------

@pytest.fixture(scope="module")
def real():
    from fxcoalesce.apps.spec import smollm2
    from fxcoalesce.apps.spec.draft_head import load_head

    target, tok = smollm2.load_target()
    draft, _ = load_head(HEAD, target_name=smollm2.NAME, target_args=target.args,
                         embed_weight=target.embed.weight.detach().clone())
    return target, draft, tok


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 2, 3), (2, 3, 8)])
def test_simulate_takes_the_decoders_steps(real, shape):
    """The accepted lengths the chooser predicts from are the decoder's own, step by step."""
    from fxcoalesce.apps.spec.prompts import held_out_prompts
    from fxcoalesce.models import eagle3_static as es
    from fxcoalesce.models.eagle3 import prefill

    target, draft, tok = real
    prompt = tok.encode_chat(held_out_prompts(3)[2])
    k, d, n = shape
    spec = es.TreeSpec(top_k=k, depth=d, total_tokens=n)
    with torch.no_grad():
        target.setup_cache(1, 192)
        draft.setup_cache(192 + spec.draft_slots())
        out, stats = es.speculative_generate_static(target, draft, torch.tensor(prompt), 32,
                                                    spec=spec, stop_tokens=(tok.eos_id,))
        _, hidden = prefill(target, torch.tensor(prompt + out))
        sim = tc.simulate(draft, hidden, prompt + out, len(prompt), spec)
    assert len(sim) >= len(stats.accepted) - 3  # the last steps could run past the text
    assert sim == stats.accepted[: len(sim)]
    assert max(sim) > 1  # the head accepts something: the walk is not trivially all ones


def test_decide_measures_caches_and_is_forced(real, tmp_path, monkeypatch):
    """auto measures (this machine's step times, the head's stored acceptance), chooses what
    ``choose`` chooses from those numbers, and keeps it; the next auto reads it back; greedy
    and K,D,N are forced without measuring."""
    target, draft, tok = real
    monkeypatch.setenv("FXCOALESCE_CACHE", str(tmp_path))
    monkeypatch.setattr(tc, "CANDIDATES", ((1, 1, 2), (1, 3, 4)))
    prompt = tok.encode_chat("Why is the sky blue?")
    target.setup_cache(1, 128)
    draft.setup_cache(128 + 8)
    kw = dict(target=target, draft=draft, tok=tok, head=HEAD, prompt=prompt, group=None,
              dev=torch.device("cpu"), dtype=torch.float32)
    choice, rec = tc.decide("auto", **kw)
    assert rec["source"] == "measured" and set(rec["step_s"]) == {"1,1,2", "1,3,4"}
    assert all(v > 0 for v in rec["step_s"].values()) and rec["greedy_step_s"] > 0
    stored = json.loads((HEAD / tc.STATS_FILE).read_text())["float32"]
    assert rec["accepted"] == {k: stored[k]["accepted_length"] for k in ("1,1,2", "1,3,4")}
    again = tc.choose(rec["greedy_step_s"], rec["step_s"], rec["accepted"])
    assert (choice.shape, choice.reason) == (again.shape, again.reason)
    assert Path(rec["cache"]).is_file() and Path(rec["cache"]).is_relative_to(tmp_path)
    cached_choice, cached = tc.decide("auto", **kw)
    assert cached["source"] == "cached" and cached_choice.shape == choice.shape
    assert cached["step_s"] == rec["step_s"]
    assert tc.decide("greedy", **kw)[0].shape is None
    assert tc.decide((1, 3, 4), **kw)[0].shape == (1, 3, 4)


def test_decide_times_the_finalists_as_the_decoding_runs_them(real, tmp_path, monkeypatch):
    """With the decoding's steps given (a GPU: compiled), the screen's best predicted trees
    are timed again with them and the choice follows those times: a finalist whose step is
    slow as the decoding runs it loses, however fast its uncompiled screen was."""
    import time

    from fxcoalesce.models import eagle3_static as es

    target, draft, tok = real
    monkeypatch.setenv("FXCOALESCE_CACHE", str(tmp_path))
    monkeypatch.setattr(tc, "CANDIDATES", ((1, 1, 2), (1, 2, 3), (1, 3, 4)))
    monkeypatch.setattr(tc, "FINALISTS", 2)
    prompt = tok.encode_chat("Why is the sky blue?")
    target.setup_cache(1, 128)
    draft.setup_cache(128 + 8)
    calls = []

    def step_fn(target, draft, state, pairs, spec):
        calls.append(spec.total_tokens)
        if spec.total_tokens == 4:
            time.sleep(0.4)
        return es.spec_step(target, draft, state, pairs, spec)

    choice, rec = tc.decide("measure", target=target, draft=draft, tok=tok, head=HEAD,
                            prompt=prompt, group=None, dev=torch.device("cpu"),
                            dtype=torch.float32, compiled=(es.decode_step, step_fn))
    screen = rec["screen"]["step_s"]
    stored = json.loads((HEAD / tc.STATS_FILE).read_text())["float32"]
    rates = {k: stored[k]["accepted_length"] / t for k, t in screen.items()}
    finalists = sorted(rates, key=rates.get, reverse=True)[:2]
    assert rec["timed"] == "compiled" and set(rec["step_s"]) == set(finalists)
    assert set(calls) == {int(k.split(",")[2]) for k in finalists}  # only they ran again
    if "1,3,4" in finalists:
        assert rec["step_s"]["1,3,4"] > 0.4 > screen["1,3,4"]
    assert choice.shape != (1, 3, 4)
    again = tc.choose(rec["greedy_step_s"], rec["step_s"], rec["accepted"])
    assert (choice.shape, choice.reason) == (again.shape, again.reason)
    kw = dict(target=target, draft=draft, prompt=prompt, group=None, dev=torch.device("cpu"),
              greedy_fn=es.decode_step, step_fn=step_fn, capture=False)
    n = len(calls)
    if choice.shape is not None:  # timed as it runs already: not again
        assert tc.confirm(choice, rec, **kw).shape == choice.shape and len(calls) == n


def test_confirm_turns_to_greedy_when_the_compiled_step_is_slower(real, tmp_path, monkeypatch):
    """After its compile the chosen tree's step is timed as it will run; a step that no
    longer beats greedy gives greedy, and the factor goes into the cached decision, which the
    next choice applies to every candidate."""
    import time

    from fxcoalesce.models import eagle3_static as es

    target, draft, tok = real
    monkeypatch.setenv("FXCOALESCE_CACHE", str(tmp_path))
    prompt = tok.encode_chat("Why is the sky blue?")
    target.setup_cache(1, 128)
    draft.setup_cache(128 + 8)
    key = tc.machine_key(torch.device("cpu"), 1, torch.float32, HEAD)
    record = {"source": "measured", "greedy_step_s": 0.1, "step_s": {"1,1,2": 0.1},
              "accepted": {"1,1,2": 1.5}, "key": key}
    record["cache"] = str(tc.write_cached(key, record))
    choice = tc.choose(0.1, record["step_s"], record["accepted"])
    assert choice.shape == (1, 1, 2)

    def slow_step(*args):
        time.sleep(0.5)
        return es.spec_step(*args)

    kw = dict(target=target, draft=draft, prompt=prompt, group=None, dev=torch.device("cpu"),
              greedy_fn=es.decode_step, capture=False)
    after = tc.confirm(choice, record, step_fn=slow_step, **kw)
    assert after.shape is None and "compiled, measured" in after.reason
    assert record["compiled_factor"] > 1.5
    cached = tc.read_cached(key)
    assert cached["compiled_factor"] == record["compiled_factor"]
    assert tc.choose(0.1, tc.corrected(cached), cached["accepted"]).shape is None
    forced = {"source": "forced"}
    assert tc.confirm(choice, forced, step_fn=slow_step, **kw).shape == (1, 1, 2)


def test_time_steps_hands_back_each_rounds_pair(real):
    """The CPU demo's sign test reads every round: (its greedy step, each candidate's step),
    in seconds, the candidate's right after the greedy step it is paired with."""
    import time

    from fxcoalesce.models import eagle3_static as es

    target, draft, tok = real
    prompt = tok.encode_chat("Why is the sky blue?")
    target.setup_cache(1, 128)
    draft.setup_cache(128 + 8)

    def slow_step(*args):
        time.sleep(0.3)
        return es.spec_step(*args)

    rounds = []
    greedy_s, step_s = tc.time_steps(target, draft, prompt, [(1, 1, 2)], reps=3,
                                     step_fn=slow_step, capture=False, per_round=rounds)
    assert len(rounds) == 3
    assert all(g > 0 and len(t) == 1 and t[0] > 0.3 for g, t in rounds), rounds
    assert step_s["1,1,2"] > 0.3 and greedy_s > 0


def test_learn_keeps_what_the_decoding_realized(tmp_path, monkeypatch):
    """A tree predicted at 1.5x that decoded at 0.75x: the cached factor doubles, and the
    next choice from the cache is greedy."""
    monkeypatch.setenv("FXCOALESCE_CACHE", str(tmp_path))
    key = tc.machine_key(torch.device("cpu"), 2, torch.float32, HEAD)
    record = {"source": "measured", "greedy_step_s": 0.1, "step_s": {"1,1,2": 0.1},
              "accepted": {"1,1,2": 1.5}, "key": key}
    record["cache"] = str(tc.write_cached(key, record))
    learned = tc.learn(record, (1, 1, 2), 0.75)
    assert learned == {"tree": "1,1,2", "predicted": 1.5, "realized": 0.75,
                       "compiled_factor": 2.0}
    cached = tc.read_cached(key)
    assert cached["compiled_factor"] == 2.0
    assert tc.choose(0.1, tc.corrected(cached), cached["accepted"]).shape is None
    assert tc.learn({"source": "forced"}, (1, 1, 2), 0.5) is None


def _two_ranks_worker(rank: int, world: int, cache: str) -> list:
    """decide then confirm, twice (measured, then from rank 0's cache): every collective of
    the timing pairs across the ranks, and both follow rank 0's tree."""
    import os

    import torch.distributed as dist

    from fxcoalesce.models import eagle3 as e3
    from fxcoalesce.models import eagle3_static as es
    from fxcoalesce.models import llama

    os.environ["FXCOALESCE_CACHE"] = cache
    torch.set_num_threads(1)
    target = llama.build(llama.TINY)
    draft = e3.build_draft(e3.DraftArgs.for_target(target.args), seed=1)
    llama.apply_tp(target, dist.group.WORLD)
    room, draft_room, _ = tc.room_for_candidates()
    target.setup_cache(1, 64 + room)
    draft.setup_cache(64 + room + draft_room)
    seen = []
    for _ in range(2):
        choice, record = tc.decide("spec", target=target, draft=draft, tok=None, head=HEAD,
                                   prompt=list(range(3, 20)), group=dist.group.WORLD,
                                   dev=torch.device("cpu"), dtype=torch.float32)
        after = tc.confirm(choice, record, target=target, draft=draft,
                           prompt=list(range(3, 20)), group=dist.group.WORLD,
                           dev=torch.device("cpu"), greedy_fn=es.decode_step,
                           step_fn=es.spec_step, capture=False, spec=choice.spec)
        seen.append((record.get("source"), choice.shape, after.shape))
    return seen


@pytest.mark.slow  # 22 s on 2 shared cores
def test_two_ranks_decide_and_confirm_together(tmp_path):
    """On 2 gloo ranks: the second decision comes from rank 0's cache, where rank 1 holds no
    record; its confirmation still times on both ranks (it hung when rank 1 skipped it)."""
    from fxcoalesce.apps.launch import spawn

    ranks = spawn(_two_ranks_worker, 2, (str(tmp_path),), backend="gloo", timeout=300)
    r0, r1 = ranks
    assert [s for s, _, _ in r0] == ["measured", "cached"]
    assert [s[1:] for s in r0] == [s[1:] for s in r1]  # rank 0's trees on both
    assert all(shape is not None for _, shape, _ in r0)  # --tree spec: a tree


def test_a_captured_step_keeps_the_tensors_it_reads_alive(monkeypatch):
    """A CUDA graph reads its inputs at fixed addresses and holds none of them: the replay
    ``_replayable`` returns must hold the captured function and so its tensors, or their
    memory goes to later tensors and the replay reads garbage (the GPU path's index_copy_
    assert, session 7). Capture is faked: the lifetime is the point, not the GPU."""
    import gc
    import weakref

    class FakeGraph:
        replays = 0

        def replay(self):
            FakeGraph.replays += 1

    class FakeCapture:
        def __init__(self, graph, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    state = torch.zeros(4, dtype=torch.long)
    alive = weakref.ref(state)
    run = tc._replayable(lambda state=state: state.sum(), torch.device("cuda"), None)
    del state
    gc.collect()
    assert alive() is not None, "the replay let the captured step's tensors go"
    before = FakeGraph.replays
    run()
    assert FakeGraph.replays == before + 1  # it replays the graph, not the step eagerly


def test_the_guard_compares_step_rates_leaving_the_prefill_out():
    """The guard that lets greedy take over: a tree at 3 tokens a 1 s step against greedy's
    2.5 tokens/s keeps going although the prefill took 100 s before its first step (charged
    to the first steps' tokens, as on the H100 in session 8, it looked 0.09x); one at
    2 tokens a step (0.8x) is given up at step GUARD_FIRST, not before; one whose answer opens
    slowly (1 token a step for 4 steps, then 4: on the H100 in session 12, 3 of 32 prompts
    gave up at step 4 so, each ~2x past its opening) keeps going."""
    from fxcoalesce.apps.spec import specdecode as sd

    clock = {"t": 0.0}

    def run(per_step: int | list[int], stall: dict | None = None) -> list[int]:
        guard = sd.step_rate_guard(2.5, None, torch.device("cpu"), clock=lambda: clock["t"])
        clock["t"] = 100.0  # the prefill
        gave_up, tokens = [], 1
        for step in range(1, 17):
            clock["t"] += 1.0 + (stall or {}).get(step, 0.0)
            tokens += per_step if isinstance(per_step, int) else per_step[step - 1]
            if guard(step, tokens):
                gave_up.append(step)
        return gave_up

    assert run(3) == []
    gave_up = list(range(sd.GUARD_FIRST, 17, sd.GUARD_EVERY))
    assert gave_up[0] == sd.GUARD_FIRST
    assert run(2) == gave_up
    assert run([1] * 4 + [4] * 12) == []
    # one step stalled 3 s (the mean pace 9 tokens in 6 s: 1.5 tokens/s) is not a slow tree
    assert run(3, {2: 3.0}) == []
    # a slowdown that lasts (every step from the second 1.5 s: 2 tokens/s) is
    assert run(3, {s: 0.5 for s in range(2, 17)}) == gave_up


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("tree", ["auto", (8, 7, 96), (1, 1, 2)])
def test_the_caches_hold_a_forced_tree_as_well_as_every_candidate(tree, device):
    """cache_len / draft_room size the KV caches before the tree is known: for every candidate
    and for a forced tree outside them (a forced (8, 7, 96) once overran the draft cache sized
    for (8, 6, 64): "the draft KV cache (424) must hold the target's (384) plus 48"), and on
    CUDA for the step launched past the end (``specdecode.LAUNCH_AHEAD``)."""
    from fxcoalesce.apps.spec.specdecode import SpecOptions, ahead, cache_len, draft_room
    from fxcoalesce.models import eagle3_static as es

    P = 90 if tree == (8, 7, 96) else 60  # where the step past the end needs 64 slots more
    opt = SpecOptions(gguf="", draft="", prompts=((1,) * P,), tree=tree, device=device)
    T = cache_len(opt)
    shapes = list(tc.CANDIDATES) + ([tree] if isinstance(tree, tuple) else [])
    for k, d, n in shapes:
        spec = es.TreeSpec(top_k=k, depth=d, total_tokens=n)
        past = spec.pairs if ahead(opt) else 0
        es._check_room(P, opt.tokens, T, spec.total_tokens + past, T + draft_room(opt),
                       spec.draft_slots())  # raises where a cache is short
