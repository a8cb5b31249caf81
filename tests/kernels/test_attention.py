"""Paged attention over a mixed decode/prefill batch vs the contiguous reference, write_kv, and
the fused ops (RMSNorm, RoPE, SiLU-and-mul) vs Hugging Face transformers' Llama."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (LlamaRMSNorm, apply_rotary_pos_emb,
                                                      rotate_half)

from pagewire.kernels.activation import silu_and_mul
from pagewire.kernels.attention import (AttentionBatch, PrefillSpan, paged_attention,
                                        reference_attention, write_kv)
from pagewire.kernels.norm import add_rms_norm, rms_norm
from pagewire.kernels.rotary import apply_rope, rope_cos_sin
from pagewire.kernels.ops import select_ops

# Sequences of the batch, decodes first: (context_len once this step's tokens are written,
# tokens computed this step). Decodes cover a lone token, block-boundary and long contexts;
# prefills cover fresh prompts and chunks on top of cached context, with ragged lengths.
DECODES = [(1, 1), (37, 1), (64, 1), (5, 1)]
PREFILLS = [(19, 19), (50, 7), (33, 2), (3, 3), (70, 45)]


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size


def _build(block_size, head_dim, num_heads, num_kv_heads, seed=0):
    """A randomly filled cache holding each sequence's earlier context at shuffled blocks, plus
    this step's q, k, v, the AttentionBatch, and each sequence's full contiguous K/V."""
    g = torch.Generator().manual_seed(seed)
    seqs = DECODES + PREFILLS
    blocks_needed = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_needed) + 3                      # a few never used
    ids = torch.randperm(num_blocks, generator=g)            # shuffled, non-contiguous
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    tables, offset = [], 0
    for n in blocks_needed:
        tables.append(ids[offset:offset + n])
        offset += n
    qs, ks, vs, slot_mapping, full_kv = [], [], [], [], []
    for (ctx, n), table in zip(seqs, tables):
        keys = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        values = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        prior = torch.arange(ctx - n)
        cache[0].view(-1, num_kv_heads, head_dim)[_slots(table, prior, block_size)] = keys[:ctx - n]
        cache[1].view(-1, num_kv_heads, head_dim)[_slots(table, prior, block_size)] = values[:ctx - n]
        qs.append(torch.randn(n, num_heads, head_dim, generator=g))
        ks.append(keys[ctx - n:])
        vs.append(values[ctx - n:])
        slot_mapping.append(_slots(table, torch.arange(ctx - n, ctx), block_size))
        full_kv.append((keys, values))
    nd = len(DECODES)
    max_blocks = max(blocks_needed[:nd])
    decode_tables = torch.zeros(nd, max_blocks, dtype=torch.int64)   # padded with block 0
    for i, (ctx, _) in enumerate(DECODES):
        decode_tables[i, :blocks_needed[i]] = tables[i]
    context_lens = torch.tensor([ctx for ctx, _ in DECODES], dtype=torch.int64)
    spans, start = [], nd
    for (ctx, n), table in zip(PREFILLS, tables[nd:]):
        spans.append(PrefillSpan(start=start, num_tokens=n, context_len=ctx, block_table=table))
        start += n
    batch = AttentionBatch(slot_mapping=torch.cat(slot_mapping), num_decode_tokens=nd,
                           decode_block_tables=decode_tables, decode_context_lens=context_lens,
                           prefills=spans)
    return cache, torch.cat(qs), torch.cat(ks), torch.cat(vs), batch, full_kv


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_attention_matches_reference(block_size, head_dim, num_heads, num_kv_heads, kernels):
    cache, q, k, v, batch, full_kv = _build(block_size, head_dim, num_heads, num_kv_heads)
    scale = head_dim ** -0.5
    out = select_ops(torch.device("cpu"), kernels).attention(q, k, v, cache, batch, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    row = 0
    for (ctx, n), (keys, values) in zip(DECODES + PREFILLS, full_kv):
        expected = reference_attention(q[row:row + n], keys, values, scale)
        torch.testing.assert_close(out[row:row + n], expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"sequence ctx={ctx} n={n}: {m}")
        row += n
    assert row == q.shape[0]


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_writes_this_steps_kv(block_size):
    cache, q, k, v, batch, full_kv = _build(block_size, 64, 4, 2, seed=1)
    before = cache.clone()
    paged_attention(q, k, v, cache, batch, 0.125)
    flat = cache.view(2, -1, 2, 64)
    assert torch.equal(flat[0, batch.slot_mapping], k)
    assert torch.equal(flat[1, batch.slot_mapping], v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[batch.slot_mapping] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 64)[:, untouched])


def test_decode_ignores_blocks_outside_its_context():
    """Padding entries (block 0) and slots past a decode's context are masked:
    filling every block no decode owns, and the unused tail slots, with garbage changes
    nothing."""
    cache, q, k, v, batch, _ = _build(16, 64, 4, 2, seed=2)
    nd = batch.num_decode_tokens
    out = paged_attention(q, k, v, cache.clone(), batch, 0.125)
    owned = {b for i, (ctx, _) in enumerate(DECODES)
             for b in batch.decode_block_tables[i, :math.ceil(ctx / 16)].tolist()}
    scrambled = cache.clone()
    for b in set(range(cache.shape[1])) - owned:
        scrambled[:, b] = 1e4                     # large but finite
    for i, (ctx, _) in enumerate(DECODES):
        last = batch.decode_block_tables[i, (ctx - 1) // 16]
        scrambled[:, last, (ctx - 1) % 16 + 1:] = -1e4
    out2 = paged_attention(q, k, v, scrambled, batch, 0.125)
    torch.testing.assert_close(out2[:nd], out[:nd], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_writes_exactly_the_named_slots(block_size):
    num_blocks, hkv, d = 6, 2, 8
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"))
    g = torch.Generator().manual_seed(3)
    total = num_blocks * block_size
    slots = torch.randperm(total, generator=g)[: max(1, total // 2)]
    k = torch.randn(len(slots), hkv, d, generator=g)
    v = torch.randn(len(slots), hkv, d, generator=g)
    write_kv(cache, k, v, slots)
    for i, s in enumerate(slots.tolist()):
        block, offset = divmod(s, block_size)
        assert torch.equal(cache[0, block, offset], k[i])
        assert torch.equal(cache[1, block, offset], v[i])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written.view(-1)[slots] = True
    assert not cache[:, written].isnan().any()
    assert cache[:, ~written].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama_rms_norm(dtype):
    g = torch.Generator().manual_seed(4)
    hf = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=g) * 0.5 + 1)
    hf = hf.to(dtype)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    with torch.no_grad():
        expected = hf(x)
    out = rms_norm(x, hf.weight.detach(), 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_add_rms_norm_matches_add_then_llama_rms_norm():
    g = torch.Generator().manual_seed(5)
    hf = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x, residual = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    weight = hf.weight.detach()
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, x + residual)
    with torch.no_grad():
        torch.testing.assert_close(normed, hf(x + residual), atol=1e-6, rtol=1e-6)
        normed0, residual0 = add_rms_norm(x, None, weight, 1e-6)
        assert torch.equal(residual0, x)
        torch.testing.assert_close(normed0, hf(x), atol=1e-6, rtol=1e-6)


def _hf_cos_sin(head_dim, positions, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0)])
def test_apply_rope_matches_hf_apply_rotary_pos_emb(head_dim, theta):
    g = torch.Generator().manual_seed(6)
    positions = torch.tensor([0, 1, 2, 17, 255, 1000, 4095, 3])
    q = torch.randn(len(positions), 4, head_dim, generator=g)
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    cos, sin = _hf_cos_sin(head_dim, positions, theta)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)   # [T, heads, D]
    table = rope_cos_sin(head_dim, 4096, theta)
    assert table.shape == (4096, head_dim) and table.dtype == torch.float32
    torch.testing.assert_close(apply_rope(q, table[positions]), q_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(k, table[positions]), k_hf, atol=1e-5, rtol=1e-5)
    # Spelled out with rotate_half, the definition.
    torch.testing.assert_close(apply_rope(q, table[positions]),
                               q * cos[:, None] + rotate_half(q) * sin[:, None],
                               atol=1e-5, rtol=1e-5)


def test_apply_rope_in_bf16_matches_hf():
    g = torch.Generator().manual_seed(7)
    positions = torch.arange(0, 300, 13)
    x = torch.randn(len(positions), 3, 64, generator=g).to(torch.bfloat16)
    cos, sin = _hf_cos_sin(64, positions, 10000.0)
    expected, _ = apply_rotary_pos_emb(x, x, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    out = apply_rope(x, rope_cos_sin(64, 300, 10000.0)[positions].to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


def test_rope_cos_sin_uses_given_inv_freq():
    inv_freq = torch.tensor([1.0, 0.5, 0.25, 0.0])
    table = rope_cos_sin(8, 5, theta=1.0, inv_freq=inv_freq)
    pos = torch.arange(5, dtype=torch.float32)[:, None]
    assert torch.equal(table, torch.cat([(pos * inv_freq).cos(), (pos * inv_freq).sin()], -1))
    assert torch.equal(table[0], torch.tensor([1.0] * 4 + [0.0] * 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_silu_gate_times_up(dtype):
    g = torch.Generator().manual_seed(8)
    gate, up = torch.randn(6, 40, generator=g).to(dtype), torch.randn(6, 40, generator=g).to(dtype)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    assert out.shape == (6, 40) and out.dtype == dtype
    torch.testing.assert_close(out, F.silu(gate) * up, atol=0, rtol=0)


def _seen_through_key_ends(q, keys, values, ends, window, scale):
    """The definition with PrefillSpan.key_ends: query i (position ctx - n + i) sees keys
    < ends[i] and, with a window, > its position - window. Float32."""
    n, ctx = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    pos = torch.arange(ctx - n, ctx).unsqueeze(1)
    k_pos = torch.arange(ctx).unsqueeze(0)
    mask = (k_pos < ends.unsqueeze(1)) & ((k_pos > pos - window) if window else True)
    scores = torch.einsum("qhd,khd->hqk", q.float(),
                          keys.float().repeat_interleave(group, 1)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values.float().repeat_interleave(group, 1))


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_key_ends_let_a_query_see_past_itself(kernels, dtype, window):
    """Gemma 3's image tokens: in the prefill spans (ctx 50, n 7) and (ctx 70, n 45), a run of
    queries sees keys up to its run's end (cpu, bfloat16: the native prefill kernel's
    key_ends); a window still counts back from each query's own position."""
    from pagewire.kernels.attention import Variant
    cache, q, k, v, batch, full_kv = _build(16, 64, 4, 2)
    cache, q, k, v = (x.to(dtype) for x in (cache, q, k, v))
    for span, (lo, hi) in zip([batch.prefills[1], batch.prefills[4]], [(1, 5), (10, 30)]):
        past = span.context_len - span.num_tokens
        span.key_ends = torch.arange(past + 1, span.context_len + 1)
        span.key_ends[lo:hi] = past + hi
    assert batch.beyond_causal
    scale = 64 ** -0.5
    out = select_ops(torch.device("cpu"), kernels).attention(q, k, v, cache, batch, scale,
                                                              Variant(window=window))
    row = batch.num_decode_tokens
    for span, (keys, values) in zip(batch.prefills, full_kv[len(DECODES):]):
        n, ctx = span.num_tokens, span.context_len
        ends = span.key_ends if span.key_ends is not None else torch.arange(ctx - n + 1, ctx + 1)
        expected = _seen_through_key_ends(q[row:row + n], keys.to(dtype), values.to(dtype),
                                          ends, window, scale)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[row:row + n].float(), expected, atol=tol, rtol=tol)
        row += n
