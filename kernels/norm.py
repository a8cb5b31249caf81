"""RMSNorm, optionally fused with the residual add that precedes it: the torch reference and
the Triton kernel."""
from __future__ import annotations

import torch

from ._triton import (HAS_TRITON, check, check_float, check_same_device, next_pow2,
                      out_or_new, require_triton, tl, triton)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> [T, H]. Normalizes in float32 and casts back before the weight multiply,
    the order Hugging Face's LlamaRMSNorm uses (it matters in bf16)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_split(x: torch.Tensor, weight: torch.Tensor, eps: float, width: int,
                   all_reduce) -> torch.Tensor:
    """rms_norm of a vector `width` wide whose columns are split over tensor-parallel ranks:
    x [T, w] and weight [w] this rank's columns; the sum of squares (float32 [T, 1]) summed
    over the ranks by `all_reduce` (OLMoE's q/k norms over every head under -tp)."""
    x32 = x.float()
    squares = all_reduce(x32.pow(2).sum(-1, keepdim=True))
    return weight * (x32 * torch.rsqrt(squares / width + eps)).to(x.dtype)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (x alone where None), rounded to x's dtype; returns
    (layer_norm(residual'), residual'), the norm as torch's (float32 inside)."""
    residual = x if residual is None else x + residual
    return torch.nn.functional.layer_norm(residual, (residual.shape[-1],), weight, bias,
                                          eps), residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (or x when residual is None); returns (rms_norm(residual'),
    residual')."""
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual


if HAS_TRITON:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, hidden, stride_x, stride_r,
                             stride_o, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row: residual' = x + residual (stored back, in x's dtype), then
        rms_norm(residual') in float32, cast to x's dtype, times the weight."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        # Every op in float32, rounded to x's dtype where torch rounds (the same results as
        # native half-precision ops, which the Triton interpreter does not emulate).
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
        normed = (x32 * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, normed * w, mask=mask)


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, *, out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """As add_rms_norm, one Triton launch. x [T, H] (rows may be strided, last dimension
    contiguous); residual [T, H] or None, updated IN PLACE to x + residual; weight [H] of
    x's dtype. Returns (normed, residual') where residual' is `residual` (or x when None)."""
    require_triton()
    check(x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}")
    tokens, hidden = x.shape
    check_float("x", x)
    check(x.stride(-1) == 1, "x: last dimension must be contiguous")
    check(tuple(weight.shape) == (hidden,), f"weight must be [{hidden}], got {tuple(weight.shape)}")
    check_float("weight", weight, x.dtype)
    check(weight.is_contiguous(), "weight must be contiguous")
    if residual is not None:
        check(tuple(residual.shape) == (tokens, hidden),
              f"residual must be [{tokens}, {hidden}], got {tuple(residual.shape)}")
        check_float("residual", residual, x.dtype)
        check(residual.stride(-1) == 1, "residual: last dimension must be contiguous")
        check_same_device(x=x, residual=residual, weight=weight)
    check_same_device(x=x, weight=weight)
    out = out_or_new(out, (tokens, hidden), x)
    if tokens:
        _add_rms_norm_kernel[(tokens,)](
            x, residual if residual is not None else x, weight, out, hidden, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden))
    return out, (x if residual is None else residual)
