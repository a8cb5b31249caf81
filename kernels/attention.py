"""Attention over the paged KV cache for a flattened batch that mixes decodes and prefills.

Cache layout, one tensor per layer: kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values). Slot s of the pool is block s // block_size, offset s % block_size.
A quantized cache (kv_quant.py) is read dequantized, and always read: a prompt attends its own
keys and values as stored, so an output does not depend on whether its prefix was cached or
how its prompt was chunked.

The batch is ordered decodes first: tokens [0, num_decode_tokens) are one token each of a
distinct sequence; the rest are prefill spans (a whole prompt, or one chunk of it).

The Triton kernels for CUDA (split-K decode, varlen prefill, the whole-batch launcher) are in
attention_triton.py and re-exported here, at the bottom.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import kv_quant
from .cascade import SharedPrefix, cascade_decode
from .cache import triton_write_kv, write_kv  # noqa: F401  (the cache write lives in cache.py)


@dataclass
class PrefillSpan:
    start: int                 # index of this span's first token in the flattened batch
    num_tokens: int            # query tokens computed this step
    context_len: int           # tokens in the cache for this sequence once this step's are written
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64
    # Per query, the end (exclusive) of the keys it sees, [num_tokens] int64 on the host, or
    # None: causal (a query at position p sees keys < p + 1). Gemma 3's image tokens see their
    # whole image (an image's tokens all end at its end); never past context_len, never
    # below p + 1. A window still counts back from the query's own position.
    key_ends: torch.Tensor | None = None


@dataclass
class AttentionBatch:
    """How the step's tokens map onto sequences and cache slots. Built once per step by the
    runner and read, never mutated, by every layer."""
    slot_mapping: torch.Tensor                # [T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor | None  # [B] int64: tokens each decode attends (its own included)
    prefills: list[PrefillSpan]
    cascade: SharedPrefix | None = None       # blocks every decode row starts with (cascade.py)
    heads: object | None = None               # KV-Compress's rows (kv_compress.HeadBatch)

    @functools.cached_property
    def beyond_causal(self) -> bool:
        """Whether a prefill span's queries see keys past their own (PrefillSpan.key_ends):
        Triton's causal-only prefill takes the torch path then."""
        return any(span.key_ends is not None for span in self.prefills)

    @functools.cached_property
    def packed_key_ends(self) -> torch.Tensor | None:
        """The spans' key ends as the native prefill kernel takes them: int64 [T'], one per
        row up to the last prefill row (a causal span's rows their position + 1; decode
        rows unread), or None where every span is causal."""
        if not self.beyond_causal:
            return None
        ends = torch.zeros(max(s.start + s.num_tokens for s in self.prefills),
                           dtype=torch.int64)
        for s in self.prefills:
            ends[s.start:s.start + s.num_tokens] = s.key_ends if s.key_ends is not None else \
                torch.arange(s.context_len - s.num_tokens + 1, s.context_len + 1)
        return ends

    @functools.cached_property
    def packed_prefills(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill spans as the native kernel takes them, built on first use (once a
        step, not once a layer): chunks [S, 4] int64 rows (start, num_tokens, context_len,
        offset of the span's block table) and the spans' block tables concatenated."""
        offsets, total = [], 0
        for span in self.prefills:
            offsets.append(total)
            total += span.block_table.shape[0]
        chunks = torch.tensor([[s.start, s.num_tokens, s.context_len, o]
                               for s, o in zip(self.prefills, offsets)], dtype=torch.int64)
        return chunks.view(-1, 4), torch.cat([s.block_table for s in self.prefills])

    @functools.cached_property
    def packed_prefill_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct blocks packed_prefills' tables name [U], and those tables as indices
        into them: what a quantized cache's native prefill dequantizes (found once a step)."""
        return torch.unique(self.packed_prefills[1], return_inverse=True)


@dataclass(frozen=True)
class Variant:
    """What some architectures add to plain causal attention: a sliding window (a query sees
    its own and the window - 1 keys before it), soft-capped scores
    (cap * tanh(score / cap), Gemma2) and sinks (gpt-oss): a learned logit per query head that
    joins each row's softmax denominator and contributes no value (float32 [Hq], this rank's
    heads). Variants compare by window and softcap only (a tensor has no truth value)."""
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None


PLAIN = Variant()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    batch: AttentionBatch, scale: float, write=write_kv,
                    decode=None, prefill=None, variant: Variant = PLAIN) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens. Writes k, v into the cache, then
    returns each token's attention output over its sequence's context: [T, Hq, D]. `write`
    and `decode` may be replaced by faster implementations with the same contracts
    (decode_attention's, variant and lse included); `prefill(q, kv_cache, batch, scale,
    variant, out)` may take every prefill span at once (writing their rows of out, returning
    True) or decline (False). Decode rows under a shared prefix (batch.cascade) attend it
    once for all (cascade.py), except in sliding-window layers and with sinks."""
    write(kv_cache, k, v, batch.slot_mapping)
    nd = batch.num_decode_tokens
    if not batch.prefills and nd == q.shape[0]:    # decode only: the kernel's output is it
        return _decodes(q, kv_cache, batch, scale, variant, decode or decode_attention)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decodes(q[:nd], kv_cache, batch, scale, variant, decode or decode_attention)
    if prefill is not None and prefill(q, kv_cache, batch, scale, variant, out):
        return out
    fresh: dict[int, list[PrefillSpan]] = {}
    for span in batch.prefills:
        if _reads_fresh(span, kv_cache, variant):
            fresh.setdefault(span.num_tokens, []).append(span)
            continue
        end = span.start + span.num_tokens
        out[span.start:end] = prefill_attention(q[span.start:end], k[span.start:end],
                                                v[span.start:end], kv_cache, span, scale,
                                                variant)
    for spans in fresh.values():
        _fresh_prefills(q, k, v, spans, scale, out)
    return out


def _decodes(q, kv_cache, batch: AttentionBatch, scale: float, variant: Variant,
             decode) -> torch.Tensor:
    """The decode rows' attention by `decode`, through the cascade where the batch has one."""
    if batch.cascade is None or variant.window is not None or variant.sinks is not None:
        return decode(q, kv_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
                      variant)
    return cascade_decode(q, kv_cache.shape[3], batch.cascade,
                          lambda q, tables, lens: decode(q, kv_cache, tables, lens, scale,
                                                         variant, lse=True))


def _fresh_prefills(q, k, v, spans: list[PrefillSpan], scale: float, out: torch.Tensor) -> None:
    """Prompts with nothing cached before them, all of one length: one causal attention call
    over the stack of them (one small call per prompt costs several times more on CPU)."""
    n = spans[0].num_tokens
    def stack(x):                                            # -> [S, heads, n, D]
        return torch.stack([x[s.start:s.start + n] for s in spans]).transpose(1, 2)
    o = F.scaled_dot_product_attention(stack(q), stack(k), stack(v), is_causal=True,
                                       scale=scale, enable_gqa=True).transpose(1, 2)
    for i, span in enumerate(spans):
        out[span.start:span.start + n] = o[i]


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float,
                     variant: Variant = PLAIN, lse: bool = False):
    """One query token per sequence, attending its first context_lens[b] cached tokens (the
    last `window` of them with a window). q: [B, Hq, D] -> [B, Hq, D]; with `lse`, also each
    row's log-sum-exp of its scores (the sink's among them), float32 [B, Hq]
    (cascade.merge_attention)."""
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    width = block_tables.shape[1] * block_size
    pos = torch.arange(width, device=q.device)[None, :]
    visible = pos < context_lens[:, None]                                             # [B, L]
    if variant.window is not None:
        visible &= pos >= context_lens[:, None] - variant.window
    bias = torch.zeros(visible.shape, device=q.device).masked_fill_(~visible, float("-inf"))
    bias = bias[:, None, None, :]                                                     # [B,1,1,L]
    group = num_heads // num_kv_heads
    keys = kv_quant.readable(kv_cache[0][block_tables], q.dtype) \
        .flatten(1, 2).transpose(1, 2)                                  # [B, Hkv, L, D]
    values = kv_quant.readable(kv_cache[1][block_tables], q.dtype) \
        .flatten(1, 2).transpose(1, 2)                                  # [B, Hkv, L, D]
    qg = q.view(batch, num_kv_heads, group, head_dim)                  # [B, Hkv, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores + bias
    if variant.sinks is not None:              # one more logit a row, which has no value
        sink = variant.sinks.float().view(1, num_kv_heads, group, 1)
        scores = torch.cat([scores, sink.expand(batch, -1, -1, -1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if variant.sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs, values).view(batch, num_heads, head_dim)
    if not lse:
        return out
    return out, torch.logsumexp(scores, dim=-1).view(batch, num_heads)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      span: PrefillSpan, scale: float, variant: Variant = PLAIN) -> torch.Tensor:
    """Causal attention of one sequence's new tokens. q: [n, Hq, D]; k, v: [n, Hkv, D] (the
    same tokens, already in the cache). Earlier context, if any, is read from the cache."""
    n = span.num_tokens
    if _reads_fresh(span, kv_cache, variant):      # nothing cached: the fresh k, v directly
        mask, causal = None, True
    else:
        if span.context_len != n or kv_quant.is_quantized(kv_cache):
            k = _gather(kv_cache[0], span.block_table, span.context_len, q.dtype)  # [ctx,Hkv,D]
            v = _gather(kv_cache[1], span.block_table, span.context_len, q.dtype)
        mask = causal_mask(n, span.context_len, q.device, variant.window, span.key_ends)
        causal = False
    return attend(q, k, v, mask, causal, scale, variant)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool, scale: float, variant: Variant = PLAIN) -> torch.Tensor:
    """Attention of one sequence's queries q [n, Hq, D] over keys and values [ctx, Hkv, D]
    (not paged): under `mask` [n, ctx] (bool, True: visible), or causal when `causal` (then
    mask is None and ctx == n). -> [n, Hq, D]."""
    if variant.softcap is not None or variant.sinks is not None:
        if causal:
            mask = causal_mask(q.shape[0], k.shape[0], q.device)
        if variant.softcap is None:
            return _sdpa_with_sinks(q, k, v, mask, scale, variant.sinks)
        return _explicit(q, k, v, mask, scale, variant)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=True)                                                # [1, Hq, n, D]
    return out.squeeze(0).transpose(0, 1)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   lib=None) -> torch.Tensor:
    """A vision tower's attention: every query of an image sees every key of it (no cache, no
    mask). q, k, v: [N, P, H, D] (heads contiguous) -> [N, P, H, D]. On the native prefill
    kernel where it serves (bfloat16, D 64 or 128, AVX512-BF16; `lib` a native Library): each
    image's keys laid as cache blocks of 16 (padded), one chunk an image, every query's key end
    the image's last key; else torch's SDPA (60-150 GFLOP/s here against the kernel's ~400)."""
    n, p, h, d = q.shape
    padded = -(-p // 16) * 16

    def blocks(x: torch.Tensor) -> torch.Tensor:                  # -> [N P' / 16, 16, H, D]
        x = F.pad(x, (0, 0, 0, 0, 0, padded - p)) if padded != p else x.contiguous()
        return x.view(n * padded // 16, 16, h, d)
    if lib is None or not lib.prefill_attention_serves(q, k.new_empty(1, 16, h, d)):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), scale=scale)
        return out.transpose(1, 2)                                   # [N, P, H, D]
    chunks = torch.tensor([[i * p, p, p, i * padded // 16] for i in range(n)])
    out = q.new_empty(n * p, h, d)
    lib.prefill_attention(q.reshape(n * p, h, d), blocks(k), blocks(v), chunks,
                          torch.arange(n * padded // 16), scale, None, out,
                          key_ends=torch.full((n * p,), p))
    return out.view(n, p, h, d)


def causal_mask(num_queries: int, context_len: int, device: torch.device,
                window: int | None = None, key_ends: torch.Tensor | None = None
                ) -> torch.Tensor:
    """[n, ctx] bool: query i (at position ctx - n + i) sees keys at positions <= its own,
    or < key_ends[i] where given (PrefillSpan.key_ends), and, with a window, > its own -
    window (transformers' AND(window, OR(causal, same image)))."""
    q_pos = torch.arange(context_len - num_queries, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos if key_ends is None else k_pos < key_ends.to(device).unsqueeze(1)
    return mask if window is None else mask & (k_pos > q_pos - window)


def _explicit(q, k, v, mask, scale: float, variant: Variant) -> torch.Tensor:
    """Attention with capped scores (SDPA has no hook for it), and sinks beside them. q:
    [n, Hq, D]; k, v: [ctx, Hkv, D]; mask [n, ctx] -> [n, Hq, D]. Float32 scores, as Gemma2
    in transformers; a sink is one more column of each head's softmax, dropped after it."""
    group = q.shape[1] // k.shape[1]
    kq = k.repeat_interleave(group, dim=1)                               # [ctx, Hq, D]
    vq = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kq).float() * scale         # [Hq, n, ctx]
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if variant.sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = variant.sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs.to(q.dtype), vq)


def _sdpa_with_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks through SDPA (whose CPU flash kernel never holds a [Hq, n, ctx]
    score matrix: long prompts' chunks stay within memory), the sink as one more key every
    query sees: each head's vectors gain a column, 0 in the real keys and values, sink / scale
    in each query (its head's sink), 1 in the sink's key, whose value is zero. Its score is
    then the sink, the real keys' scores are unchanged, and the extra output column is
    dropped (sink / scale is rounded to q's dtype: exact in bfloat16 for gpt-oss's bfloat16
    sinks and head_dim 64, scale 1/8). q: [n, Hq, D]; k, v: [ctx, Hkv, D]; mask [n, ctx]
    -> [n, Hq, D]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    extra = (sinks.float() / scale).to(q.dtype).view(1, hq, 1).expand(n, hq, 1)
    q1 = torch.cat([q, extra], dim=-1)                                    # [n, Hq, D+1]
    sink_key = k.new_zeros(1, hkv, d + 1)
    sink_key[..., d] = 1
    k1 = torch.cat([F.pad(k, (0, 1)), sink_key])                          # [ctx+1, Hkv, D+1]
    v1 = torch.cat([F.pad(v, (0, 1)), v.new_zeros(1, hkv, d + 1)])
    mask1 = torch.cat([mask, mask.new_ones(n, 1)], dim=1)                 # the sink: seen
    out = F.scaled_dot_product_attention(
        q1.transpose(0, 1).unsqueeze(0), k1.transpose(0, 1).unsqueeze(0),
        v1.transpose(0, 1).unsqueeze(0), attn_mask=mask1, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)[..., :d]


def apply_sinks(out: torch.Tensor, lse: torch.Tensor,
                sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed without sinks -> with them: out [B, Hq, D] (q's dtype) and its rows'
    log-sum-exp lse [B, Hq] float32. A row's softmax over its scores and the sink is its
    softmax over the scores times Z / (Z + e^sink) = sigmoid(lse - sink), so the sink needs no
    kernel of its own: the torch form of the native pw_apply_sinks (CpuOps scales its decode
    kernel's rows so), and a backend's way to add sinks to a kernel that returns lse.
    Returns (out, lse with the sink)."""
    sinks = sinks.float()
    share = torch.sigmoid(lse - sinks)                                   # [B, Hq]
    return (out.float() * share[..., None]).to(out.dtype), torch.logaddexp(lse, sinks)


def _reads_fresh(span: PrefillSpan, kv_cache: torch.Tensor, variant: Variant) -> bool:
    """Whether a span attends this step's k, v as computed: a whole prompt, plain attention,
    a cache that stores them exactly, causal."""
    return (span.context_len == span.num_tokens and variant.plain and span.key_ends is None
            and not kv_quant.is_quantized(kv_cache))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int,
            dtype: torch.dtype) -> torch.Tensor:
    """cache: [num_blocks, bs, Hkv, D] -> this sequence's first `length` slots as `dtype`:
    [length, Hkv, D]."""
    return kv_quant.readable(cache[block_table].flatten(0, 1)[:length], dtype)


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The definition, for tests: causal attention of the last len(q) positions of one sequence.
    q: [n, Hq, D]; keys, values: [ctx, Hkv, D], contiguous (not paged). Float32 math."""
    n, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)                    # [ctx, Hq, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale         # [Hq, n, ctx]
    scores = scores.masked_fill(~causal_mask(n, ctx, q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


# The Triton launchers (importing them needs no Triton; calling them does).
from .attention_triton import (triton_decode_attention, triton_paged_attention,  # noqa: E402,F401
                               triton_prefill_attention, varlen_prefills)
