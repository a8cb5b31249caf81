"""Writing this step's keys and values into the paged KV cache.

Cache layout, one tensor per layer: kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values), head_dim + 4 bytes per head for a quantized cache (kv_quant.py).
Slot s of the pool is block s // block_size, offset s % block_size.
"""
from __future__ import annotations

import torch

from . import kv_quant
from ._triton import HAS_TRITON, check, check_same_device, next_pow2, require_triton, tl, triton


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v ([T, Hkv, D]) at their slots, quantized if the cache is. Mutates kv_cache."""
    _, _, _, num_kv_heads, width = kv_cache.shape
    if kv_quant.is_quantized(kv_cache):        # copied as bytes (no float8 index_copy_)
        k = kv_quant.quantize(k, kv_cache.dtype).view(torch.uint8)
        v = kv_quant.quantize(v, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, v)


if HAS_TRITON:
    @triton.jit
    def _round_to_grid(y, MANT: tl.constexpr, EMIN: tl.constexpr):
        """y rounded to the nearest value with MANT mantissa bits and exponent >= EMIN (ties
        away from zero): what a float8 code holds, so converting it is exact (the Triton
        interpreter's float8 conversion drops a mantissa carry)."""
        bits = tl.abs(y).to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
        step = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
        return tl.where(y >= 0, tl.floor(y / step + 0.5), tl.ceil(y / step - 0.5)) * step

    @triton.jit
    def _store_rows(rows, dims, x, mask, h_mask, head_dim, QMAX: tl.constexpr,
                    QUANT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
        """x [H, D] into the heads' rows (pointers [H]): as it is, or as codes rounded to
        nearest (ties away from zero) and each head's float32 scale after its D codes."""
        dst = rows[:, None] + dims[None, :]
        if QUANT:
            xf = x.to(tl.float32)
            amax = tl.max(tl.where(mask, tl.abs(xf), 0.0), 1)                        # [H]
            inv = tl.where(amax > 0, QMAX / amax, 0.0)
            y = tl.minimum(tl.maximum(xf * inv[:, None], -QMAX), QMAX)
            if MANT == 0:           # int8
                y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
            else:
                y = _round_to_grid(y, MANT, EMIN)
            tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)
            scale_at = (rows + head_dim).to(tl.pointer_type(tl.float32), bitcast=True)
            tl.store(scale_at, amax / QMAX, mask=h_mask)
        else:
            tl.store(dst, x, mask=mask)

    @triton.jit
    def _write_kv_kernel(cache_ptr, k_ptr, v_ptr, slot_ptr, num_kv_heads, head_dim,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_c, stride_cb, stride_cs, stride_ch,
                         BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         QMAX: tl.constexpr, QUANT: tl.constexpr, MANT: tl.constexpr,
                         EMIN: tl.constexpr):
        """One program per token: its [Hkv, D] keys and values into its slot (slots < 0 are
        padding and skipped)."""
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            heads = tl.arange(0, BLOCK_H)
            dims = tl.arange(0, BLOCK_D)
            h_mask = heads < num_kv_heads
            mask = h_mask[:, None] & (dims[None, :] < head_dim)
            rows = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb
                    + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch)
            key = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                          mask=mask)
            value = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                            mask=mask)
            _store_rows(rows, dims, key, mask, h_mask, head_dim, QMAX, QUANT, MANT, EMIN)
            _store_rows(rows + stride_c, dims, value, mask, h_mask, head_dim, QMAX, QUANT, MANT,
                        EMIN)


def triton_write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """As write_kv, one Triton launch. k, v: [T, Hkv, D] of the cache's dtype (any float
    dtype for a quantized cache), rows may be strided views (last dimension contiguous);
    slot_mapping: [T] int64, distinct (a negative slot is padding: that token is not
    written). Mutates kv_cache."""
    require_triton()
    check(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
          f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    head_dim, quantized = kv_quant.head_dim(kv_cache), kv_quant.is_quantized(kv_cache)
    check(kv_cache.stride(-1) == 1, "kv_cache: last dimension must be contiguous")
    for name, t in (("k", k), ("v", v)):
        check(t.dim() == 3 and tuple(t.shape[1:]) == (num_kv_heads, head_dim),
              f"{name} must be [T, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}")
        check(quantized or t.dtype == kv_cache.dtype,
              f"{name}: dtype {t.dtype} differs from the cache's {kv_cache.dtype}")
        check(t.stride(-1) == 1, f"{name}: last dimension must be contiguous")
    check(k.shape[0] == v.shape[0], f"k and v token counts differ: {k.shape[0]}, {v.shape[0]}")
    check(slot_mapping.dtype == torch.int64 and slot_mapping.dim() == 1
          and slot_mapping.shape[0] == k.shape[0] and slot_mapping.is_contiguous(),
          f"slot_mapping must be contiguous [{k.shape[0]}] int64, got {tuple(slot_mapping.shape)} "
          f"{slot_mapping.dtype}")
    check_same_device(kv_cache=kv_cache, k=k, v=v, slot_mapping=slot_mapping)
    if k.shape[0] == 0:
        return
    _write_kv_kernel[(k.shape[0],)](
        kv_cache, k, v, slot_mapping, num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        QMAX=kv_quant.QMAX.get(kv_cache.dtype, 0.0), QUANT=quantized,
        **_FLOAT8_GRID.get(kv_cache.dtype, dict(MANT=0, EMIN=0)))


# Mantissa bits and least normal exponent of the float8 cache dtypes.
_FLOAT8_GRID = {torch.float8_e4m3fn: dict(MANT=3, EMIN=-6),
                torch.float8_e5m2: dict(MANT=2, EMIN=-14)}
