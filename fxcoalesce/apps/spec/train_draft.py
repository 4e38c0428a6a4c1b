"""``fxcoalesce train-draft``: an EAGLE-3 draft head for SmolLM2-135M, by self-distillation.

    1. generate  the target answers training prompts (apps/spec/prompts.py: templates x topics,
                 offline and identical on every machine), greedy, chat template, batched;
                 its captured states (3H) and final normed states (H) are kept per token
    2. vocab     the draft vocabulary: the most frequent tokens of the responses (d2t)
    3. train     EAGLE-3's training-time test (models/eagle3_train.py): ``ttt_steps`` unrolled
                 draft steps, soft cross-entropy against the target's distribution over the
                 draft vocabulary, step k weighted 0.8^k
    4. save      safetensors shards + config.json (apps/spec/draft_head.py), every
                 ``checkpoint_s`` and at the end

``minutes`` bounds generation and training together (loading comes on top): generation
stops at ``gen_share`` of it, training at the end. Initialisation: the draft's embedding is
the target's (frozen); the rest is seeded as ``eagle3.build_draft`` does. (Starting the head
from the target's output rows of the draft vocabulary and its final norm from the target's
was worse: on 48 responses, held-out loss 5.71 against 4.88 after 100 steps, top-1 0.21
against 0.29; the head's large initial logits cost ~7 nats to unlearn.)
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fxcoalesce.apps.spec import prompts as prompt_source
from fxcoalesce.apps.spec import smollm2
from fxcoalesce.apps.spec.draft_head import save_head


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    out: str
    """Directory for the head (config.json, index, shards) and train_log.json."""
    target: str = smollm2.NAME
    """Target model (only SmolLM2-135M has pretrained weights here)."""
    device: str = "cuda"
    """"cuda" or "cpu"."""
    minutes: float = 5.0
    """Wall-time budget for generation and training together."""
    gen_share: float = 0.4
    """Generation stops starting batches after this share of the budget."""
    prompts: int | None = None
    """Use only the first N training prompts (None: all ~19k)."""
    gen_batch: int = 256
    """Prompts answered together."""
    gen_tokens: int = 256
    """Longest response generated."""
    draft_vocab: int = 8192
    """Draft vocabulary size."""
    ttt_steps: int = 7
    """Unrolled draft steps per training position (EAGLE-3's training-time test)."""
    batch_tokens: int = 16384
    """Training positions per optimizer step (whole sequences, padded)."""
    lr: float = 1e-3
    """Peak AdamW learning rate (warm-up over 20 steps, then a cosine to 10% at the deadline,
    or after ``epochs`` where those come first)."""
    epochs: float | None = None
    """Stop after this many passes over the generated data (None: at the deadline); the
    learning rate's cosine then follows the passes, or the clock if that runs out first.
    At most 1, every batch is text the head has not trained on when ``last_top1`` scores it
    (one pass on an H100: 0.61 on the last batch, 0.53 on held-out templates: the gap is the
    templates, not repeated text; benchmarks/NOTES.md, session 10)."""
    checkpoint_s: float = 60.0
    """Seconds between checkpoints."""
    held_out: int = 16
    """Held-out prompts (templates and topics training never saw) whose greedy answers the
    head is scored on, as ``last_top1`` scores a training batch: ``held_out_top1`` in the log
    (the finished head), the agreement a decoder can expect on new text, and
    ``held_out_curve`` (at every checkpoint: whether more epochs still help; 0: no score)."""
    seed: int = 0


@dataclass(slots=True)
class Sample:
    ids: torch.Tensor
    """[n] long, CPU: prompt (chat template) then response."""
    prompt_len: int
    states: torch.Tensor
    """[n - 1, 3H]: the target's captured states h_0 .. h_{n-2}."""
    normed: torch.Tensor
    """[n - 1, H]: the target's final normed states (its head input) at the same positions."""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@torch.inference_mode()
def generate_samples(target, embed: torch.Tensor, prompts: list[list[int]], *, batch: int,
                     max_new: int, eos: int, deadline: float) -> list[Sample]:
    """Greedy responses of ``target`` to ``prompts`` (token ids), ``batch`` at a time, left
    padded (RoPE is relative: padding shifts positions, not attention); stops starting
    batches at ``deadline``."""
    dev = embed.device
    T = max(map(len, prompts)) + max_new
    target.setup_cache(batch, T)
    keys = torch.arange(T, device=dev)
    samples, tokens_made, t0 = [], 0, time.perf_counter()
    for start in range(0, len(prompts), batch):
        if time.perf_counter() > deadline:
            say(f"  generation stops at its deadline: {start} of {len(prompts)} prompts")
            break
        chunk = prompts[start : start + batch]
        B, P = len(chunk), max(map(len, chunk))
        pad = torch.tensor([P - len(p) for p in chunk], device=dev)
        tokens = torch.full((B, P), eos, device=dev)
        for b, p in enumerate(chunk):
            tokens[b, P - len(p):] = torch.tensor(p, device=dev)
        qpos = torch.arange(P, device=dev)
        mask = ((keys <= qpos[:, None]) & (keys >= pad[:, None, None])) | (keys == qpos[:, None])
        normed, states = target.features(tokens, qpos, qpos, mask[:, None])  # pads see themselves
        nxt = F.linear(normed[:, -1], embed).argmax(-1)  # [B]
        made, done, step_states, step_normed = [nxt], nxt == eos, [], []
        for i in range(max_new - 1):
            if i % 16 == 0 and bool(done.all()):
                break
            pos = torch.tensor([P + i], device=dev)
            m = (keys <= P + i) & (keys >= pad[:, None])  # [B, T]
            h, s = target.features(nxt[:, None], pos, pos, m[:, None, None])
            step_states.append(s[:, 0])
            step_normed.append(h[:, 0])
            nxt = torch.where(done, eos, F.linear(h[:, 0], embed).argmax(-1))
            made.append(nxt)
            done |= nxt == eos
        made_t = torch.stack(made, 1).cpu()  # [B, n]
        dec_states = torch.stack(step_states, 1) if step_states else states[:, :0]
        dec_normed = torch.stack(step_normed, 1) if step_normed else normed[:, :0]
        for b, p in enumerate(chunk):
            resp = made_t[b].tolist()
            n = resp.index(eos) + 1 if eos in resp else len(resp)
            lo = P - len(p)
            samples.append(Sample(
                torch.tensor(p + resp[:n]), len(p),
                torch.cat([states[b, lo:], dec_states[b, : n - 1]]).clone(),
                torch.cat([normed[b, lo:], dec_normed[b, : n - 1]]).clone()))
            tokens_made += n
        elapsed = time.perf_counter() - t0
        say(f"  generated {len(samples)}/{len(prompts)} responses, {tokens_made} tokens, "
            f"{elapsed:.0f} s ({tokens_made / elapsed:.0f} tokens/s)")
    target.setup_cache(1, 1)  # free the generation cache
    return samples


def draft_vocabulary(samples: list[Sample], vocab: int, size: int) -> tuple[torch.Tensor, float]:
    """(target ids of the draft vocabulary [size], ascending; share of response tokens it
    covers): the most frequent response tokens, ties to the lower id."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.ids[s.prompt_len:], minlength=vocab)
    ids = torch.argsort(-counts, stable=True)[:size]
    return ids.sort().values, float(counts[ids].sum() / max(int(counts.sum()), 1))


def init_draft(target, vocab_ids: torch.Tensor, device, seed: int):
    """Float32 draft for ``target`` over the draft vocabulary ``vocab_ids``: seeded layers and
    head, the target's embedding (frozen)."""
    from fxcoalesce.models import eagle3 as e3

    args = e3.DraftArgs.for_target(target.args, draft_vocab=vocab_ids.numel())
    d2t = vocab_ids - torch.arange(vocab_ids.numel())
    draft = e3.build_draft(args, d2t=d2t, device=device, seed=seed)
    with torch.no_grad():
        draft.embed.weight.copy_(target.embed.weight.detach().float())
    draft.embed.weight.requires_grad_(False)
    return draft


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Sample indices grouped by similar length, at most ``batch_tokens`` padded positions
    each, in random order."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    groups, cur = [], []
    for i in order:
        longest = len(samples[i].ids)  # sorted: the newest is the longest
        if cur and (len(cur) + 1) * longest > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(samples: list[Sample], dev):
    """-> tokens [B, S] (x_{p+1} at position p), states [B, S, 3H] (h_p), normed [B, S, H]
    (the target's head input at p + 1, whose distribution is the label), valid [B, S]
    (x_{p+2} is a response token), for S = longest - 2 positions."""
    S = max(len(s.ids) for s in samples) - 2
    B = len(samples)
    tokens = torch.zeros(B, S, dtype=torch.long)
    valid = torch.zeros(B, S, dtype=torch.bool)
    states = samples[0].states.new_zeros(B, S, samples[0].states.shape[-1])
    normed = samples[0].normed.new_zeros(B, S, samples[0].normed.shape[-1])
    for b, s in enumerate(samples):
        n = len(s.ids) - 2
        tokens[b, :n] = s.ids[1 : n + 1]
        valid[b, max(s.prompt_len - 2, 0) : n] = True
        states[b, :n] = s.states[:n]
        normed[b, :n] = s.normed[1 : n + 1]
    return tokens.to(dev), states, normed, valid.to(dev)


def top1_counts(logits: list[torch.Tensor], want: torch.Tensor,
                valid: torch.Tensor) -> list[tuple[int, int]]:
    """Per unrolled step k: (positions where the draft's argmax is ``want``, positions scored),
    over valid positions with a parent (p >= k)."""
    pos = torch.arange(valid.shape[1], device=valid.device)
    out = []
    for k, lg in enumerate(logits):
        ok = valid & (pos >= k)
        out.append((int(((lg.argmax(-1) == want) & ok).sum()), int(ok.sum())))
    return out


def ttt_loss(logits: list[torch.Tensor], labels: torch.Tensor, valid: torch.Tensor):
    """Soft cross-entropy of each unrolled step against ``labels`` [B, S, Vd] (probabilities),
    over valid positions with a parent (p >= k); steps weighted 0.8^k. -> (loss, per-step
    losses, per-step top-1 agreement with the target)."""
    pos = torch.arange(valid.shape[1], device=valid.device)
    want = labels.argmax(-1)
    total, weight, losses = 0.0, 0.0, []
    for k, lg in enumerate(logits):
        ok = valid & (pos >= k)
        ce = -(labels * lg.float().log_softmax(-1)).sum(-1)[ok].mean()
        total, weight = total + 0.8**k * ce, weight + 0.8**k
        losses.append(float(ce.detach()))
    accs = [h / n if n else float("nan") for h, n in top1_counts(logits, want, valid)]
    return total / weight, losses, accs


def agreement(draft, samples: list[Sample], head_rows: torch.Tensor, steps: int, dev,
              batch: int = 8) -> list[float]:
    """Per unrolled step, the top-1 agreement ``ttt_loss`` reports for one batch, pooled over
    ``samples`` in batches of ``batch`` (no gradients)."""
    from fxcoalesce.models.eagle3_train import unrolled_forward

    hits, seen = [0] * steps, [0] * steps
    for start in range(0, len(samples), batch):
        tokens, states, normed, valid = collate(samples[start : start + batch], dev)
        with torch.no_grad():
            want = F.linear(normed, head_rows).argmax(-1)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = unrolled_forward(draft, tokens, states, steps)
        for k, (h, n) in enumerate(top1_counts(logits, want, valid)):
            hits[k], seen[k] = hits[k] + h, seen[k] + n
    return [h / max(n, 1) for h, n in zip(hits, seen)]


def progress(elapsed: float, budget: float, step: int, epochs: float | None,
             per_epoch: int) -> float:
    """How far training is, 0 to 1: the clock's share of the budget, or the steps' share of
    ``epochs`` passes of ``per_epoch`` steps where that is further."""
    done = elapsed / budget
    if epochs is not None:
        done = max(done, step / (epochs * per_epoch))
    return min(done, 1.0)


def lr_decay(done: float) -> float:
    """The learning rate's factor at ``progress`` ``done``: a cosine from 1 to 0.1."""
    return 0.1 + 0.45 * (1 + math.cos(math.pi * done))


def run_train_draft(opt: TrainOptions, command: str = "") -> dict:
    from fxcoalesce.models.eagle3_train import unrolled_forward

    t_start = time.perf_counter()
    torch.manual_seed(opt.seed)
    dev = torch.device(opt.device)
    cuda = dev.type == "cuda"
    out = Path(opt.out)
    target, tok = smollm2.load_target(device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
    embed = target.embed.weight.detach()
    prompts = prompt_source.training_prompts(opt.seed)[: opt.prompts]
    ids = [tok.encode_chat(p) for p in prompts]
    t0 = time.perf_counter()
    say(f"train-draft: {opt.target} on {dev}, loaded in {t0 - t_start:.0f} s; budget "
        f"{opt.minutes} min (generation <= {opt.gen_share:.0%}); {len(prompts)} prompts")
    deadline = t0 + opt.minutes * 60
    samples = generate_samples(target, embed, ids, batch=opt.gen_batch, max_new=opt.gen_tokens,
                               eos=tok.eos_id, deadline=t0 + opt.gen_share * opt.minutes * 60)
    t_gen = time.perf_counter() - t0
    vocab_ids, coverage = draft_vocabulary(samples, target.args.vocab, opt.draft_vocab)
    say(f"draft vocabulary: {opt.draft_vocab} tokens cover {coverage:.1%} of the responses")
    draft = init_draft(target, vocab_ids, dev, opt.seed)
    head_rows = embed[vocab_ids.to(dev)]  # labels: the target's logits over the draft vocab
    params = [p for p in draft.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opt.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(opt.seed)
    stats = {"target": opt.target, "device": str(dev), "prompts_used": len(samples),
             "response_tokens": sum(len(s.ids) - s.prompt_len for s in samples),
             "generate_s": round(t_gen, 1), "vocab_coverage": round(coverage, 4),
             "data": "apps/spec/prompts.py training templates x topics (held-out ones excluded), "
                     "responses generated by the target (greedy, chat template)",
             "options": asdict(opt), "command": command, "steps": 0, "epochs": 0.0}
    config = {"target": opt.target, "target_vocab": target.args.vocab,
              "target_dim": target.args.dim, "capture_layers": list(target.args.capture_layers),
              "training": stats}

    held = []
    if opt.held_out:  # answered now, scored at every checkpoint: the curve is not training
        texts = prompt_source.held_out_prompts(opt.held_out)
        held = generate_samples(target, embed, [tok.encode_chat(t) for t in texts],
                                batch=opt.gen_batch, max_new=opt.gen_tokens, eos=tok.eos_id,
                                deadline=math.inf)

    def save(final: bool) -> None:
        stats["train_s"] = round(time.perf_counter() - t_train, 1)
        if held:
            top1 = [round(x, 4) for x in agreement(draft, held, head_rows, opt.ttt_steps, dev)]
            stats["held_out_curve"] = stats.get("held_out_curve", []) + [
                {"epochs": stats["epochs"], "top1": top1, "last_top1": stats.get("last_top1")}]
            if final:
                stats["held_out_top1"], stats["held_out_prompts"] = top1, len(held)
                say(f"  held-out top-1 ({len(held)} prompts training never saw): "
                    f"{' '.join(f'{x:.2f}' for x in top1)}")
        save_head(draft, out, config)
        say(f"  {'saved' if final else 'checkpoint'}: {out} (step {stats['steps']})")

    t_train = last_print = last_save = time.perf_counter()
    train_budget = max(deadline - t_train, 1e-6)
    epoch = 0
    done = not samples
    while not done:
        groups = batches(samples, opt.batch_tokens, rng)
        for g, group in enumerate(groups):
            now = time.perf_counter()
            if now >= deadline or (opt.epochs is not None
                                   and epoch + g / len(groups) >= opt.epochs):
                done = True
                break
            step = stats["steps"]
            # every pass has as many groups (they depend on the samples' lengths only)
            decay = lr_decay(progress(now - t_train, train_budget, step, opt.epochs,
                                      len(groups)))
            for grp in optim.param_groups:
                grp["lr"] = opt.lr * min(1.0, (step + 1) / 20) * decay
            tokens, states, normed, valid = collate([samples[i] for i in group], dev)
            with torch.no_grad():
                labels = F.linear(normed, head_rows).float().softmax(-1)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                logits = unrolled_forward(draft, tokens, states, opt.ttt_steps)
            loss, losses, accs = ttt_loss(logits, labels, valid)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optim.step()
            stats["steps"] = step + 1
            stats["epochs"] = round(epoch + (g + 1) / len(groups), 3)
            stats["last_loss"] = [round(x, 4) for x in losses]
            stats["last_top1"] = [round(x, 4) for x in accs]
            if now - last_print > 10 or step == 0:
                last_print = now
                say(f"  step {step + 1} (epoch {stats['epochs']:.2f}), {now - t_train:.0f} s: "
                    f"loss {' '.join(f'{x:.2f}' for x in losses)}; top-1 "
                    f"{' '.join(f'{x:.2f}' for x in accs)}")
            if now - last_save > opt.checkpoint_s:
                last_save = now
                save(final=False)
        epoch += 1
    save(final=True)
    say(f"train-draft: done in {time.perf_counter() - t_start:.0f} s ({stats['steps']} steps, "
        f"{stats['epochs']:.2f} epochs)")
    return stats
