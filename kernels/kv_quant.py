"""A quantized KV cache: each (token, kv head) vector of D values stored in one byte each
(int8, float8 e4m3 or e5m2) and followed, in the same row, by its float32 scale.

Layout: kv_cache[2, num_blocks, block_size, Hkv, D + 4] of the 1-byte dtype; the last four
bytes of each head's row are the float32 scale (max |x| / QMAX), so a value is q * scale.
Keeping the scale inside the row means every block operation (copy-on-write, swap, the draft
model's cache beside the target's) moves scales with their values, and a cache's dtype says
whether and how it is quantized. Scales come from the vector itself as it is written: no
calibration.
"""
from __future__ import annotations

import torch

from .native_api import API

# --kv-cache-dtype: the 1-byte cache dtypes ("fp8" is e4m3, as in vLLM).
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_CODES = API.enums["PwKvCache"]                 # csrc/pagewire_api.h
PLAIN = _CODES["PLAIN"]     # the fused decode's code for a cache of the activations' dtype
KINDS = {torch.int8: _CODES["INT8"], torch.float8_e4m3fn: _CODES["E4M3"],
         torch.float8_e5m2: _CODES["E5M2"]}
SCALE_BYTES = 4


def cache_layout(kv_cache_dtype: str, model_dtype: torch.dtype,
                 head_dim: int) -> tuple[torch.dtype, int]:
    """(the cache tensor's dtype, its last dimension) for --kv-cache-dtype: the model's dtype
    and D for "auto", else the 1-byte dtype and D + 4."""
    dtype = DTYPES.get(kv_cache_dtype, model_dtype)
    return dtype, head_dim + (SCALE_BYTES if dtype in QMAX else 0)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QMAX


def head_dim(cache: torch.Tensor) -> int:
    """D of a cache [..., Hkv, D] or [..., Hkv, D + 4] (quantized)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache) else 0)


def _scales(packed: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each row of packed [..., D + 4]: a view [..., 1]."""
    return packed.view(torch.uint8)[..., -SCALE_BYTES:].view(torch.float32)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] (any float dtype) -> [..., D + 4] of `dtype`: values rounded to nearest
    (int8: saturating at +-127) after division by the row's scale, then the scale."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)                              # [..., 1]
    scale = amax / QMAX[dtype]
    inv = torch.where(amax > 0, QMAX[dtype] / amax, torch.zeros_like(amax))
    y = (xf * inv).clamp(-QMAX[dtype], QMAX[dtype])
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=dtype, device=x.device)
    out[..., :x.shape[-1]] = y.round().to(dtype) if dtype == torch.int8 else y.to(dtype)
    _scales(out)[...] = scale
    return out


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [..., D + 4] -> [..., D] of `dtype` (the values times their row's scale)."""
    values = packed[..., :packed.shape[-1] - SCALE_BYTES].float()
    return (values * _scales(packed)).to(dtype)


def readable(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache slice (gathered blocks) as values of `dtype`: dequantized if need be, else
    converted (no copy where the cache already holds `dtype`)."""
    return dequantize(cache, dtype) if is_quantized(cache) else cache.to(dtype)
