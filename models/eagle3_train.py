"""EAGLE-3's training-time test: the draft layer unrolled over ``steps`` draft steps along a
known sequence, with the attention each step has at inference.

At inference the draft's first step reads the target's states (pairs (x_{p+1}, h_p) at
positions p); a tree node k levels down reads its parent's draft output instead, and
attends to the target-fed prefix up to k positions back plus its k - 1 ancestors. Training
runs every position as if it were the k-th level below position p - k, all at once:

    step 0:  hidden_0 = fc(target states)
    step k:  hidden_k[p] = out_{k-1}[p - 1]  (the draft's own output one position back)
             query p sees step 0's keys at positions <= p - k and step i's key at p - k + i

Every step predicts x_{p+2} at position p (the tree node at position p proposes the token
after its own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .eagle3 import Eagle3Draft
from .rope import rope_angles, rope_half


def ttt_mask(S: int, step: int, device=None) -> torch.Tensor:
    """[S, (step + 1) * S] bool: what query p of ``step`` sees in the keys of steps 0..step
    concatenated (step 0 causal up to p - step; step i >= 1 only position p - step + i)."""
    p = torch.arange(S, device=device)[:, None]
    q = torch.arange(S, device=device)[None, :]
    blocks = [q <= p - step] + [q == p - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, 1)


def unrolled_forward(draft: Eagle3Draft, tokens: torch.Tensor, states: torch.Tensor,
                     steps: int) -> list[torch.Tensor]:
    """tokens [B, S] (x_{p+1} at position p), states [B, S, 3H] (h_p) -> draft logits
    [B, S, Vd] of each of ``steps`` unrolled steps. Rows p < k of step k have no parent: the
    caller leaves them out of the loss."""
    B, S = tokens.shape
    a = draft.args
    heads, hd = a.n_heads, a.dim // a.n_heads
    emb = draft.embed_norm(draft.embed(tokens))
    hidden = draft.fc(states)
    cos, sin = rope_angles(torch.arange(S, device=tokens.device), hd, a.rope_theta,
                           torch.promote_types(hidden.dtype, torch.float32))
    keys, values, logits = [], [], []
    for k in range(steps):
        x = torch.cat([emb, draft.hidden_norm(hidden)], -1)  # 2H
        q, key, v = (w(x).view(B, S, heads, hd) for w in (draft.wq, draft.wk, draft.wv))
        q, key = (rope_half(t, cos[:, None], sin[:, None]) for t in (q, key))
        keys.append(key)
        values.append(v)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
            torch.cat(values, 1).transpose(1, 2), attn_mask=ttt_mask(S, k, tokens.device))
        h = hidden + draft.wo(attn.transpose(1, 2).flatten(2))
        f = draft.ffn_norm(h)
        h = h + draft.w2(F.silu(draft.w1(f)) * draft.w3(f))
        logits.append(draft.lm_head(draft.norm(h)))
        hidden = torch.cat([h.new_zeros(B, 1, h.shape[-1]), h[:, :-1]], 1)
    return logits
