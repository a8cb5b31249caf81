"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> [T, H]. Normalizes in float32 and casts back before the weight multiply,
    the order Hugging Face's LlamaRMSNorm uses (it matters in bf16)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (or x when residual is None); returns (rms_norm(residual'),
    residual')."""
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual
