"""Rotary position embedding, neox style (rotate halves), as Llama-family models use it."""
from __future__ import annotations

import torch


def rope_cos_sin(head_dim: int, max_position: int, theta: float,
                 inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """The [max_position, head_dim] table of (cos | sin) halves, in float32. `inv_freq` may be
    given by a scaled variant; the default is theta ** (-2i / head_dim)."""
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)                           # [P, D]


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos_sin: [T, D] rows already gathered at each token's position and
    cast to x's dtype. Returns a new [T, heads, D]."""
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)    # [T, 1, D/2] each
    x1, x2 = x.chunk(2, dim=-1)                         # [T, heads, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
