"""Rotary position embedding, the two layouts in use.

    cos, sin = rope_angles(pos, dim, theta)        # [S, dim/2] each
    cos, sin = rope_table(T, dim, theta)           # [T, dim/2]: the same, gathered by position
    rope_interleaved(x, cos, sin)   rotates pairs (x[2i], x[2i+1])      (Meta Llama, DeepSeek, GGUF)
    rope_half(x, cos, sin)          rotates pairs (x[i], x[i + dim/2])  (Hugging Face Llama, EAGLE)

``cos``/``sin`` must broadcast against ``x[..., :dim/2]``: for ``x`` [B, S, h, d] pass
``cos[:, None]``. Rotation runs in the dtype of ``cos`` and returns ``x``'s dtype.
"""

from __future__ import annotations

import torch


def rope_angles(pos: torch.Tensor, dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [S, dim/2] of the angles pos * theta^(-2i/dim) for positions ``pos`` [S]."""
    inv_freq = theta ** -(torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    angles = pos.float()[:, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_table(max_pos: int, dim: int, theta: float, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_pos, dim/2] of positions 0..max_pos-1: ``table[pos]`` equals
    ``rope_angles(pos, ...)``. A compiled step then gathers them by position where Inductor
    would otherwise recompute pow, cos and sin inline in every layer's kernel (an H100 spent
    12 us a layer so in the 64-token speculative step: benchmarks/NOTES.md, session 13)."""
    return rope_angles(torch.arange(max_pos, device=device), dim, theta, dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).type_as(x)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.to(cos.dtype).chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).type_as(x)
