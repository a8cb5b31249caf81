"""The quantized KV cache (kernels/kv_quant.py): rounding error bounds per dtype, the torch
write and reads, and the native write and decode attention against them."""
from __future__ import annotations

import pytest
import torch

from pagewire.kernels import kv_quant
from pagewire.kernels.attention import Variant, decode_attention
from pagewire.kernels.cache import write_kv

KINDS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# Mantissa bits and the least normal exponent of each float8 format.
FLOAT8 = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def _bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest rounding error each value of x [..., D] may carry: half a step of its
    row's scale (int8), or half a unit in the last place of the scaled value (float8)."""
    scale = x.abs().amax(-1, keepdim=True) / kv_quant.QMAX[dtype]
    if dtype == torch.int8:
        return scale / 2 * (1 + 1e-5)
    mant, least = FLOAT8[dtype]
    y = (x / scale).abs().clamp_min(2.0 ** least)             # subnormals: the least step
    ulp = 2.0 ** (torch.floor(torch.log2(y)) - mant)
    return ulp / 2 * scale * (1 + 1e-5)


@pytest.mark.parametrize("dtype", KINDS)
def test_quantize_rounds_within_half_a_step(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 80, generator=g) * torch.logspace(-6, 3, 64)[:, None, None]
    x[3, 1] = 0                                                 # a zero row: scale 0, zeros
    packed = kv_quant.quantize(x, dtype)
    assert packed.shape == (64, 4, 84) and packed.dtype == dtype
    back = kv_quant.dequantize(packed)
    err = (back - x).abs()
    bound = torch.nan_to_num(_bound(x, dtype))
    assert (err <= bound).all(), float((err - bound).max())
    assert torch.equal(back[3, 1], torch.zeros(80))
    assert err.max() > 0                                        # it does round
    rel = (err.amax(-1) / x.abs().amax(-1).clamp_min(1e-30)).max()
    assert rel <= {torch.int8: 1 / 254, torch.float8_e4m3fn: 1 / 16,
                   torch.float8_e5m2: 1 / 8}[dtype] + 1e-6


def _cache_case(dtype, hkv=2, d=64, blocks=9, bs=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, blocks, bs, hkv, d + kv_quant.SCALE_BYTES, dtype=dtype)
    tokens = blocks * bs - 3
    k, v = torch.randn(2, tokens, hkv, d, generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    return cache, k, v, slots


@pytest.mark.parametrize("dtype", KINDS)
def test_write_kv_stores_each_rows_codes_and_scale(dtype):
    cache, k, v, slots = _cache_case(dtype)
    write_kv(cache, k, v, slots)
    rows = cache.view(2, -1, 2, 68)[:, slots]                  # [2, T, Hkv, D + 4]
    for i, x in enumerate((k, v)):
        assert torch.equal(rows[i].view(torch.uint8), kv_quant.quantize(x, dtype).view(torch.uint8))
    assert kv_quant.head_dim(cache) == 64 and kv_quant.is_quantized(cache)


@pytest.mark.parametrize("dtype", KINDS)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_native_write_kv_matches_torch(native_lib, dtype, act):
    cache, k, v, slots = _cache_case(dtype)
    k, v = k.to(act), v.to(act)
    ours, ref = cache.clone(), cache.clone()
    native_lib.write_kv(ours[0], ours[1], k, v, slots)
    write_kv(ref, k, v, slots)
    # The same codes but where -ffast-math's reciprocal tips a tie (bfloat16 inputs make exact
    # ties common): values within one step.
    back, want = kv_quant.dequantize(ours), kv_quant.dequantize(ref)
    step = torch.nan_to_num(_bound(want, dtype)) * 2             # unwritten rows: 0
    assert ((back - want).abs() <= step).all()
    same = (ours.view(torch.uint8) == ref.view(torch.uint8)).float().mean()
    assert same > 0.99


@pytest.mark.parametrize("dtype", KINDS)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, variant", [(64, Variant()), (80, Variant(window=20, softcap=30.0)),
                                        (128, Variant(window=7))])
def test_native_decode_over_a_quantized_cache_matches_torch(native_lib, dtype, act, d, variant):
    g = torch.Generator().manual_seed(d)
    bs, hq, hkv = 16, 4, 2
    lens = [1, 5, 16, 17, 40, 3 * bs + 1]
    width = -(-max(lens) // bs)
    cache = torch.zeros(2, len(lens) * width + 1, bs, hkv, d + 4, dtype=dtype)
    slots = torch.arange(cache.shape[1] * bs)
    kv = torch.randn(2, slots.numel(), hkv, d, generator=g)
    write_kv(cache, kv[0], kv[1], slots)
    tables = torch.randperm(cache.shape[1], generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), hq, d, generator=g).to(act)
    ctx = torch.tensor(lens)
    for rows in (slice(0, 2), slice(None)):                    # split by kv head, and not
        out = native_lib.decode_attention(q[rows], cache[0], cache[1], tables[rows].contiguous(),
                                          ctx[rows].contiguous(), 0.125, variant.window,
                                          variant.softcap)
        ref = decode_attention(q[rows].float(), cache, tables[rows], ctx[rows], 0.125, variant)
        tol = dict(atol=1e-5, rtol=1e-5) if act == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("cache_dtype", [*KINDS, torch.bfloat16])
@pytest.mark.parametrize("d, hq, hkv, window", [(64, 9, 3, None), (64, 10, 2, 40),
                                                (128, 6, 2, None), (128, 5, 1, 21)])
def test_native_tiled_decode_reads_nothing_past_the_context(native_lib, cache_dtype, d, hq, hkv,
                                                            window):
    """bfloat16 queries over a quantized or bfloat16 cache (AVX512-BF16's tiled kernels):
    query groups that leave a partial chunk of heads, contexts that end inside a tile, a long
    one that a batch of one splits into parts, and the unwritten rows after each context
    holding NaN (quantized: NaN scales, and codes of -128, or NaN for float8): output and
    log-sum-exp are the reference's over the written rows alone."""
    g = torch.Generator().manual_seed(d + hq)
    bs, lens = 32, [1, 15, 16, 33, 70, 600]
    width = -(-max(lens) // bs)
    extra = 0 if cache_dtype == torch.bfloat16 else 4
    cache = torch.zeros(2, len(lens) * width + 1, bs, hkv, d + extra, dtype=cache_dtype)
    tables = torch.randperm(cache.shape[1], generator=g)[:len(lens) * width].view(len(lens), width)
    slots = torch.cat([tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs
                       for b, n in enumerate(lens)])
    kv = torch.randn(2, slots.numel(), hkv, d, generator=g) * 2
    if not extra:                                               # a plain cache: its own dtype
        kv = kv.to(cache_dtype)
    write_kv(cache, kv[0], kv[1], slots)
    clean = cache.clone()
    unwritten = torch.ones(cache.shape[1] * bs, dtype=torch.bool)
    unwritten[slots] = False
    rows = cache.view(2, -1, hkv, d + extra)
    if extra:
        rows.view(torch.uint8)[:, unwritten, :, :d] = 0x80 if cache_dtype == torch.int8 else 0xFF
        rows.view(torch.uint8)[:, unwritten, :, d:] = 0xFF      # a NaN scale
    else:
        rows[:, unwritten] = float("nan")
    q = (torch.randn(len(lens), hq, d, generator=g) * 3).to(torch.bfloat16)
    ctx = torch.tensor(lens)
    for part in (slice(0, 1), slice(5, 6), slice(None)):        # by kv head, parts, whole rows
        out, lse = native_lib.decode_attention(q[part], cache[0], cache[1],
                                               tables[part].contiguous(), ctx[part].contiguous(),
                                               0.125, window, lse=True)
        ref, ref_lse = decode_attention(q[part].float(), clean.float() if extra == 0 else clean,
                                        tables[part], ctx[part], 0.125, Variant(window=window),
                                        lse=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [None, 20])
def test_native_prefill_over_an_int8_cache_attends_what_the_reference_does(native_lib,
                                                                             monkeypatch, window):
    """A step of prefill chunks (fresh prompts, and chunks after context written earlier) over
    an int8 cache: the native backend's output is the torch reference's over the same codes,
    and where the tier has the bfloat16 prefill kernel, that kernel ran it."""
    from pagewire.kernels.attention import AttentionBatch, PrefillSpan, paged_attention
    from pagewire.kernels.ops import CpuOps
    g = torch.Generator().manual_seed(3)
    bs, hq, hkv, d = 16, 6, 2, 64
    chunks = [(1, 1), (17, 17), (70, 33), (130, 64)]            # (context, queries)
    need = [-(-ctx // bs) for ctx, _ in chunks]
    cache = torch.zeros(2, sum(need) + 1, bs, hkv, d + 4, dtype=torch.int8)
    ids = torch.randperm(cache.shape[1], generator=g)
    spans, slots, start, used = [], [], 0, 0
    for (ctx, n), blocks in zip(chunks, need):
        table = ids[used:used + blocks]
        slot = table[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
        if ctx > n:                                             # context of earlier steps
            write_kv(cache, *torch.randn(2, ctx - n, hkv, d, generator=g), slot[:ctx - n])
        spans.append(PrefillSpan(start, n, ctx, table))
        slots.append(slot[ctx - n:])
        start, used = start + n, used + blocks
    batch = AttentionBatch(torch.cat(slots), 0, None, None, spans)
    q = torch.randn(start, hq, d, generator=g).bfloat16()
    k, v = torch.randn(2, start, hkv, d, generator=g).bfloat16()
    kernel_calls = []
    real = native_lib.prefill_attention
    monkeypatch.setattr(native_lib, "prefill_attention",
                        lambda *a: kernel_calls.append(1) or real(*a))
    out = CpuOps(native_lib).attention(q, k, v, cache, batch, 0.125, Variant(window=window))
    ref = paged_attention(q, k, v, cache, batch, 0.125, write=lambda *a: None,
                          variant=Variant(window=window))        # the codes the backend wrote
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert len(kernel_calls) == (1 if native_lib.bf16_dot else 0)
