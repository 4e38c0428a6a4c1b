"""Draft training: the unrolled training-time-test forward against the draft's own cached
inference, and the whole train-draft pipeline on CPU at toy settings (real target)."""

import json
from dataclasses import replace

import pytest
import torch

from fxcoalesce.apps.spec import draft_head, smollm2
from fxcoalesce.apps.spec.train_draft import TrainOptions, run_train_draft
from fxcoalesce.models import eagle3 as e3
from fxcoalesce.models import llama
from fxcoalesce.models.eagle3_train import ttt_mask, unrolled_forward


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_ttt_mask():
    """Step 2 of 4 positions: query p sees step 0 up to p - 2, step 1 at p - 1, itself."""
    assert ttt_mask(4, 2).int().tolist() == [
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
    ]


@torch.no_grad()
def test_unrolled_forward_equals_cached_draft_chains():
    """Step k at position p is a tree node k levels below position p - k: the cached draft fed
    the true pairs up to p - k, then the tokens after them with its own outputs as hidden
    states, must give the same logits. Fails if a step reads the wrong previous output
    (not one position back), sees a wrong key (e.g. the whole causal prefix of step 0), or
    if RoPE positions or norms differ from Eagle3Draft.forward."""
    args = e3.DraftArgs(dim=16, n_heads=2, inter_dim=32, draft_vocab=12, target_vocab=20)
    draft = e3.build_draft(args, d2t=torch.arange(12) * 0 + 3, dtype=torch.float64, seed=4)
    gen = torch.Generator().manual_seed(0)
    S, steps = 9, 4
    tokens = torch.randint(0, 20, (1, S), generator=gen)
    states = torch.randn(1, S, 48, generator=gen, dtype=torch.float64)
    unrolled = unrolled_forward(draft, tokens, states, steps)
    T = 16
    slots = torch.arange(T)
    for k in range(steps):
        for p in range(k, S):
            draft.setup_cache(T)
            start = p - k
            pos = torch.arange(start + 1)
            logits, out = draft(tokens[:, : start + 1], draft.fc(states[:, : start + 1]), pos,
                                pos, (slots[None, :] <= pos[:, None])[None, None])
            hidden = out[:, -1:]
            for j in range(start + 1, p + 1):
                at = torch.tensor([j])
                logits, hidden = draft(tokens[:, j : j + 1], hidden, at, at,
                                       (slots <= j)[None, None, None])
            torch.testing.assert_close(unrolled[k][0, p], logits[0, -1], rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A head from the whole pipeline: 4 prompts, 24-token responses, 20 s of training."""
    out = tmp_path_factory.mktemp("head")
    opt = TrainOptions(out=str(out), device="cpu", minutes=0.4, gen_share=0.5, prompts=4,
                       gen_batch=4, gen_tokens=24, draft_vocab=512, ttt_steps=3,
                       batch_tokens=512, checkpoint_s=5, held_out=2)
    return out, run_train_draft(opt)


def test_train_draft_pipeline_on_cpu(trained):
    out, stats = trained
    config = json.loads((out / "config.json").read_text())
    assert config["target"] == "smollm2-135m" and config["target_vocab"] == 49152
    assert config["capture_layers"] == [2, 15, 27]
    assert config["draft"]["draft_vocab"] == 512 and config["dtype"] == "bfloat16"
    assert stats["prompts_used"] == 4 and stats["steps"] >= 5
    assert stats["last_loss"][0] < 6.0  # from ~14 at the start: it learns the 4 responses
    assert stats["held_out_prompts"] == 2 and len(stats["held_out_top1"]) == 3
    assert all(0.0 <= x <= 1.0 for x in stats["held_out_top1"])
    curve = stats["held_out_curve"]  # a checkpoint every 5 s over ~12 s of training, then the end
    assert len(curve) >= 2 and curve[-1]["top1"] == stats["held_out_top1"]
    assert [c["epochs"] for c in curve] == sorted(c["epochs"] for c in curve)
    index = json.loads((out / draft_head.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert all((out / s).stat().st_size <= draft_head.SHARD_BYTES + (1 << 16) for s in shards)
    assert "embed.weight" not in index["weight_map"] and "d2t" in index["weight_map"]


def test_load_head_round_trip_and_mismatches(trained, tmp_path):
    out, _ = trained
    args = llama.CONFIGS["smollm2-135m"]
    embed = torch.zeros(args.vocab, args.dim)
    draft, config = draft_head.load_head(out, target_name="smollm2-135m", target_args=args,
                                         embed_weight=embed)
    assert draft.args.draft_vocab == 512 and draft.embed.weight.data_ptr() == embed.data_ptr()
    ids = draft.to_target(torch.arange(512))
    assert ids.unique().numel() == 512 and int(ids.max()) < args.vocab

    def edited(**changes):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        bad.mkdir()
        for f in out.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "config.json").write_text(json.dumps(config | changes))
        return bad

    kw = dict(target_name="smollm2-135m", target_args=args, embed_weight=embed)
    with pytest.raises(ValueError, match="was trained for another target: target 'kimi-k2'"):
        draft_head.load_head(edited(target="kimi-k2"), **kw)
    with pytest.raises(ValueError, match="target_vocab 32000 .this target: 49152."):
        draft_head.load_head(edited(target_vocab=32000), **kw)
    with pytest.raises(ValueError, match="does not match its config"):
        draft_head.load_head(edited(draft=config["draft"] | {"inter_dim": 64}), **kw)
    other = replace(args, eagle_layers=(1, 2, 3))
    with pytest.raises(ValueError, match="capture_layers"):
        draft_head.load_head(out, target_name="smollm2-135m", target_args=other,
                             embed_weight=embed)
    with pytest.raises(ValueError, match="no config.json"):
        draft_head.load_head(tmp_path, **kw)
    assert smollm2.NAME == "smollm2-135m"


def test_agreement_pools_batches_as_one_batch_of_ttt_loss():
    """The held-out score: batches of 2 pooled by their scored positions give what
    ``ttt_loss`` reports for all samples in one batch (sequences of unequal length)."""
    from fxcoalesce.apps.spec.train_draft import Sample, agreement, collate, ttt_loss
    from fxcoalesce.models import eagle3 as e3
    from fxcoalesce.models import llama
    from fxcoalesce.models.eagle3_train import unrolled_forward

    import dataclasses

    # a draft vocabulary of 4: a random head agrees with random labels at ~1/4 of positions
    args = dataclasses.replace(e3.DraftArgs.for_target(llama.TINY), draft_vocab=4)
    draft = e3.build_draft(args, seed=3)
    H, V = args.dim, args.draft_vocab
    gen = torch.Generator().manual_seed(0)
    samples = []
    for n, prompt_len in ((9, 3), (14, 5), (6, 2), (11, 4), (8, 3)):
        ids = torch.randint(0, llama.TINY.vocab, (n,), generator=gen)
        samples.append(Sample(ids, prompt_len, torch.randn(n - 1, 3 * H, generator=gen),
                              torch.randn(n - 1, H, generator=gen)))
    head_rows = torch.randn(V, H, generator=gen)
    with torch.no_grad():
        tokens, states, normed, valid = collate(samples, torch.device("cpu"))
        labels = torch.nn.functional.linear(normed, head_rows).softmax(-1)
        _, _, want = ttt_loss(unrolled_forward(draft, tokens, states, 3), labels, valid)
    got = agreement(draft, samples, head_rows, 3, torch.device("cpu"), batch=2)
    assert got == pytest.approx(want, abs=1e-6)
    assert any(0.0 < x < 1.0 for x in got)  # not a degenerate score


def test_the_schedule_follows_the_clock_or_the_passes_whichever_is_further():
    from fxcoalesce.apps.spec.train_draft import lr_decay, progress

    assert progress(30, 120, 5, None, 10) == 0.25  # no pass limit: the clock
    assert progress(30, 120, 5, 1.0, 10) == 0.5  # half of one pass of 10 steps
    assert progress(90, 120, 5, 1.0, 10) == 0.75  # the clock ahead of the passes
    assert progress(30, 120, 40, 2.0, 10) == 1.0  # never past the end
    assert lr_decay(0.0) == 1.0 and abs(lr_decay(1.0) - 0.1) < 1e-12 and lr_decay(0.5) == 0.55
