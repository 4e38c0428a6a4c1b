"""Why speculative greedy output differs from one-token greedy in bfloat16 (GPU runs: 8 of
32 prompts equal): both in bfloat16 on CPU, the first token where they part, the float32
logit margin of the top two there, and what the bfloat16 target picks when the same tokens
come as one prefill (another shape). Usage: python benchmarks/bf16_divergence.py N TOKENS"""
import json, sys, torch
from pathlib import Path
from fxcoalesce.apps.spec import smollm2
from fxcoalesce.apps.spec.draft_head import load_head
from fxcoalesce.apps.spec.prompts import held_out_prompts
from fxcoalesce.models import eagle3_static as es, eagle3 as e3

torch.manual_seed(0)
N, TOK = int(sys.argv[1]), int(sys.argv[2])
res = []
m32, tok = smollm2.load_target()
m16, _ = smollm2.load_target(dtype=torch.bfloat16)
spec = es.TreeSpec()
for m in (m32, m16):
    m.setup_cache(1, 512)
head = Path(__file__).resolve().parents[1] / "heads" / smollm2.NAME
d16, _ = load_head(head, target_name=smollm2.NAME, target_args=m16.args,
                   embed_weight=m16.embed.weight.detach(), dtype=torch.bfloat16)
d16.setup_cache(512 + spec.draft_slots())
for text in held_out_prompts(N):
    prompt = torch.tensor(tok.encode_chat(text))
    with torch.no_grad():
        g = es.greedy_generate_static(m16, prompt, TOK, stop_tokens={tok.eos_id})
        s, st = es.speculative_generate_static(m16, d16, prompt, TOK, spec=spec, stop_tokens={tok.eos_id})
        first = next((i for i, (a, b) in enumerate(zip(g, s)) if a != b), None)
        rec = {"prompt": text[:40], "greedy": len(g), "spec": len(s), "first_diff": first}
        if first is not None:
            seq = torch.cat([prompt, torch.tensor(g[:first])])
            logits32, _ = e3.prefill(m32, seq)
            logits16, _ = e3.prefill(m16, seq)
            top = logits32[-1].float().topk(2)
            rec.update(fp32_top2=top.indices.tolist(), fp32_margin=round(float(top.values[0] - top.values[1]), 4),
                       greedy_tok=g[first], spec_tok=s[first],
                       bf16_prefill_choice=int(logits16[-1].argmax()))
    res.append(rec); print(json.dumps(rec), flush=True)
