"""A/B on this CPU: the compiled speculative step (TP 1, Inductor) with RoPE from the table
(this code) against RoPE computed per step (the code before 58c6981, patched back in)."""
import dataclasses, statistics, sys, time
import torch
from fxcoalesce.models import llama, eagle3 as e3, eagle3_static as es
from fxcoalesce.models.rope import rope_angles

def old_features(self, tokens, input_pos, cache_pos, mask):
    h = self.embed(tokens)
    rot = rope_angles(input_pos, self.args.head_dim, self.args.rope_theta,
                      torch.promote_types(h.dtype, torch.float32))
    capture, captured = self.args.capture_layers, {}
    for i, layer in enumerate(self.layers):
        if i in capture:
            captured[i] = h
        h = layer(h, rot, cache_pos, mask)
    return self.norm(h), torch.cat([captured[i] for i in capture], -1)

variant = sys.argv[1]
if variant == "inline":
    llama.Transformer.features = old_features
torch.set_num_threads(1)
torch.manual_seed(0)
args = dataclasses.replace(llama.CONFIGS["smollm2-135m"], n_layers=int(sys.argv[2]), vocab=4096)
target = llama.build(args)
draft = e3.build_draft(e3.DraftArgs.for_target(target.args), seed=1)
spec = es.TreeSpec(top_k=8, depth=6, total_tokens=64)
target.setup_cache(1, 256)
draft.setup_cache(256 + spec.draft_slots())
caches = e3.kv_caches(target) + e3.kv_caches(draft)
with torch.no_grad():
    state, pairs = es.spec_prefill_static(target, draft, *es.pad_prompt(torch.arange(3, 39)), spec.pairs)
    before = [c.clone() for c in caches]
    step = torch.compile(es.spec_step, fullgraph=True)
    t0 = time.perf_counter(); step(target, draft, state, pairs, spec); tc = time.perf_counter() - t0
    ts = []
    for r in range(15):
        for c, b in zip(caches, before):
            c.copy_(b)
        t0 = time.perf_counter(); step(target, draft, state, pairs, spec); ts.append(time.perf_counter() - t0)
print(variant, f"compile {tc:.0f} s, step median {statistics.median(ts)*1e3:.2f} ms "
      f"(p10-p90 {sorted(ts)[1]*1e3:.2f}-{sorted(ts)[-2]*1e3:.2f}) over 15")
