"""Triton attention over the paged KV cache: split-K decode (flash-decoding) and varlen
prefill, plus the whole-batch launcher TritonOps uses. The torch references and the contracts
are in kernels/attention.py, which re-exports these launchers.

Keys and values are read straight from the paged cache through the block tables, one token
position at a time within a tile, so any block size works (1 included) and a tile needs
neither block alignment nor a contiguous copy of the context. Softmax is online, in base 2
(scores pre-multiplied by scale * log2(e)), accumulated in float32. A quantized cache
(kv_quant.py) is read as its codes times each row's scale, in float32.
"""
from __future__ import annotations

import functools
import math

import torch

from . import kv_quant
from .cascade import cascade_decode
from ._triton import (HAS_TRITON, check, check_float, check_same_device, next_pow2,
                      out_or_new, require_triton, tl, triton)
from .cache import triton_write_kv

_LOG2E = 1.4426950408889634

if HAS_TRITON:
    _LN2 = tl.constexpr(0.6931471805599453)      # kernels read only constexpr globals

    @triton.jit
    def _load_rows(ptr, slot, dims, kv_mask, valid, head_dim, QUANT: tl.constexpr):
        """Rows [N, D] of keys or values at `slot` (element offsets of their heads); a
        quantized cache's codes times the float32 scale after each head's D codes."""
        # One return: the compiler types every return statement, even one a constexpr
        # branch never reaches (the interpreter does not).
        if QUANT:        # no `other`: float8 codes take none; masked lanes zeroed after
            codes = tl.load(ptr + slot[:, None] + dims[None, :], mask=kv_mask)
            scales = tl.load((ptr + slot + head_dim).to(tl.pointer_type(tl.float32),
                                                        bitcast=True), mask=valid, other=0.0)
            rows = tl.where(kv_mask, codes.to(tl.float32) * scales[:, None], 0.0)
        else:
            rows = tl.load(ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        return rows

    @triton.jit
    def _attend_tile(q, cache_ptr, table, pos, end, q_pos, kvh, dims, d_mask, m_i, l_i, acc,
                     qk_scale, head_dim, stride_c, stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, QUANT: tl.constexpr):
        """One online-softmax step of the query rows q [R, D] over the cached keys and values
        at positions `pos` (those < end; with CAUSAL, only those <= each row's q_pos).
        Returns the updated running max m_i [R], sum-exp l_i [R] and output acc [R, D]."""
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = (block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = _load_rows(cache_ptr, slot, dims, kv_mask, valid, head_dim, QUANT)
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee") * qk_scale  # [R, N]
        if CAUSAL:
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            visible = valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(cache_ptr + stride_c, slot, dims, kv_mask, valid, head_dim, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _decode_split_kernel(
            q_ptr, cache_ptr, tables_ptr, lens_ptr, mid_o_ptr, mid_m_ptr, mid_l_ptr,
            qk_scale, num_heads, group, head_dim, split_len, num_splits, head_tiles,
            stride_qb, stride_qh, stride_c, stride_cb, stride_cs, stride_ch, stride_tb,
            BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
        """Program (b, kv head x head tile, split): the query heads of one KV head (a GQA
        group, padded to BLOCK_H rows for tl.dot) over tokens [split * split_len, ...) of
        sequence b. Writes each head's normalized partial output, max and sum-exp."""
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1) // head_tiles
        split = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        start = split * split_len
        if start < ctx:
            end = tl.minimum(start + split_len, ctx)
            g = (tl.program_id(1) % head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
            heads = kvh * group + g
            h_mask = g < group
            dims = tl.arange(0, BLOCK_D)
            d_mask = dims < head_dim
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                        mask=h_mask[:, None] & d_mask[None, :], other=0.0)
            m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)   # finite: no NaN
            l_i = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            table = tables_ptr + b * stride_tb
            for n0 in range(start, end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, cache_ptr, table, n0 + tl.arange(0, BLOCK_N), end, end, kvh, dims,
                    d_mask, m_i, l_i, acc, qk_scale, head_dim, stride_c, stride_cb, stride_cs,
                    stride_ch, BLOCK_SIZE, False, QUANT)
            # mid buffers: [B, Hq, num_splits, (D)] contiguous
            row = (b * num_heads + heads) * num_splits + split
            tl.store(mid_o_ptr + row[:, None] * head_dim + dims[None, :],
                     acc / l_i[:, None], mask=h_mask[:, None] & d_mask[None, :])
            tl.store(mid_m_ptr + row, m_i, mask=h_mask)
            tl.store(mid_l_ptr + row, l_i, mask=h_mask)

    @triton.jit
    def _decode_reduce_kernel(mid_o_ptr, mid_m_ptr, mid_l_ptr, lens_ptr, out_ptr, lse_ptr,
                              num_heads, head_dim, split_len, num_splits, stride_ob, stride_oh,
                              BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                              LSE: tl.constexpr):
        """Program (b, head): merges the splits that hold tokens of sequence b; with LSE,
        also stores the row's log-sum-exp of its scores (natural log) at lse_ptr[b, head]."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        ctx = tl.load(lens_ptr + b)
        used = (ctx + split_len - 1) // split_len
        splits = tl.arange(0, BLOCK_S)
        s_mask = splits < used
        dims = tl.arange(0, BLOCK_D)
        d_mask = dims < head_dim
        row = (b * num_heads + h) * num_splits + splits
        m = tl.load(mid_m_ptr + row, mask=s_mask, other=float("-inf"))
        l = tl.load(mid_l_ptr + row, mask=s_mask, other=0.0)
        o = tl.load(mid_o_ptr + row[:, None] * head_dim + dims[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        top = tl.max(m, 0)
        w = tl.exp2(m - top) * l
        w = tl.where(s_mask, w, 0.0)
        result = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, result, mask=d_mask)
        if LSE:        # scores were scaled by log2(e): back to natural logs
            tl.store(lse_ptr + b * num_heads + h, (top + tl.log2(tl.sum(w, 0))) * _LN2)

    @triton.jit
    def _prefill_kernel(
            q_ptr, cache_ptr, starts_ptr, lens_ptr, tables_ptr, out_ptr,
            qk_scale, group, head_dim,
            stride_qt, stride_qh, stride_ot, stride_oh,
            stride_c, stride_cb, stride_cs, stride_ch, stride_tb,
            BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
        """Program (span, query head, query tile): BLOCK_M of the span's n query tokens, which
        sit at positions ctx - n ... ctx - 1 of its sequence, against the cached keys at
        positions <= their own (causal, queries at the end of the context)."""
        span = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        m0 = tl.program_id(2) * BLOCK_M
        first = tl.load(starts_ptr + span)
        n = tl.load(starts_ptr + span + 1) - first
        if m0 < n:
            ctx = tl.load(lens_ptr + span)
            kvh = h // group
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < n
            q_pos = ctx - n + rows
            dims = tl.arange(0, BLOCK_D)
            d_mask = dims < head_dim
            tokens = first + rows
            q = tl.load(q_ptr + tokens[:, None] * stride_qt + h * stride_qh + dims[None, :],
                        mask=r_mask[:, None] & d_mask[None, :], other=0.0)
            m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)   # finite: no NaN
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            end = tl.minimum(ctx, ctx - n + m0 + BLOCK_M)     # one past the tile's last query
            table = tables_ptr + span * stride_tb
            for n0 in range(0, end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, cache_ptr, table, n0 + tl.arange(0, BLOCK_N), end, q_pos, kvh, dims,
                    d_mask, m_i, l_i, acc, qk_scale, head_dim, stride_c, stride_cb, stride_cs,
                    stride_ch, BLOCK_SIZE, True, QUANT)
            tl.store(out_ptr + tokens[:, None] * stride_ot + h * stride_oh + dims[None, :],
                     acc / l_i[:, None], mask=r_mask[:, None] & d_mask[None, :])


def _check_cache(kv_cache: torch.Tensor) -> None:
    check(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
          f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    if not kv_quant.is_quantized(kv_cache):
        check_float("kv_cache", kv_cache)
    check(kv_cache.stride(-1) == 1, "kv_cache: last dimension must be contiguous")


def _check_query(q: torch.Tensor, kv_cache: torch.Tensor, name: str = "q") -> None:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_quant.head_dim(kv_cache)
    check(q.dim() == 3 and q.shape[2] == head_dim,
          f"{name} must be [tokens, Hq, {head_dim}], got {tuple(q.shape)}")
    check(q.shape[1] % num_kv_heads == 0,
          f"{name}: {q.shape[1]} query heads is not a multiple of {num_kv_heads} KV heads")
    check_float(name, q, None if kv_quant.is_quantized(kv_cache) else kv_cache.dtype)
    check(q.stride(-1) == 1, f"{name}: last dimension must be contiguous")


def _check_index(name: str, t: torch.Tensor, shape: tuple) -> None:
    check(t.dtype == torch.int64, f"{name}: dtype must be int64, got {t.dtype}")
    check(tuple(t.shape) == shape, f"{name}: shape must be {shape}, got {tuple(t.shape)}")
    check(t.stride(-1) == 1 or t.shape[-1] <= 1, f"{name}: last dimension must be contiguous")


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def triton_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, *,
                            num_splits: int | None = None, out: torch.Tensor | None = None,
                            block_n: int = 32, lse: torch.Tensor | None = None) -> torch.Tensor:
    """As attention.decode_attention: q [B, Hq, D] (rows may be strided) of the cache's dtype;
    block_tables [B, W] int64; context_lens [B] int64, each in [1, W * block_size] (not
    checked: that would wait on the device). The context is cut into `num_splits` ranges
    (default: enough programs to fill the GPU), attended in parallel, then merged. Returns
    out ([B, Hq, D], written in full); `lse` (float32 [B, Hq]), when given, gets each row's
    log-sum-exp of its scores (cascade.merge_attention)."""
    require_triton()
    _check_cache(kv_cache)
    _check_query(q, kv_cache)
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    check(block_tables.dim() == 2, f"block_tables must be [B, W], got {tuple(block_tables.shape)}")
    _check_index("block_tables", block_tables, (batch, block_tables.shape[1]))
    _check_index("context_lens", context_lens, (batch,))
    check(block_tables.shape[1] > 0, "block_tables: needs at least one column")
    check(block_n >= 16 and block_n == next_pow2(block_n), "block_n: a power of 2, >= 16")
    out = out_or_new(out, (batch, num_heads, head_dim), q)
    check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables,
                      context_lens=context_lens, out=out)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_h = min(max(16, next_pow2(group)), 64)
    head_tiles = math.ceil(group / block_h)
    tiles = math.ceil(block_tables.shape[1] * block_size / block_n)   # of the longest context
    if num_splits is None:
        programs = batch * num_kv_heads * head_tiles
        num_splits = min(tiles, max(1, math.ceil(2 * _sm_count(q.device) / programs)), 64)
    check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    split_len = math.ceil(tiles / min(num_splits, tiles)) * block_n
    num_splits = math.ceil(tiles * block_n / split_len)
    mid_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                        device=q.device)
    mid_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    mid_l = torch.empty_like(mid_m)
    block_d = next_pow2(head_dim)
    _decode_split_kernel[(batch, num_kv_heads * head_tiles, num_splits)](
        q, kv_cache, block_tables, context_lens, mid_o, mid_m, mid_l,
        scale * _LOG2E, num_heads, group, head_dim, split_len, num_splits, head_tiles,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        QUANT=kv_quant.is_quantized(kv_cache))
    if lse is not None:
        check(lse.dtype == torch.float32 and lse.shape == (batch, num_heads)
              and lse.is_contiguous(), "lse: float32 [B, Hq], contiguous")
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_m, mid_l, context_lens, out, mid_m if lse is None else lse, num_heads,
        head_dim, split_len, num_splits, out.stride(0), out.stride(1),
        BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, LSE=lse is not None)
    return out


def triton_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start: torch.Tensor,
                             context_lens: torch.Tensor, block_tables: torch.Tensor,
                             scale: float, *, max_query_len: int | None = None,
                             out: torch.Tensor | None = None, block_m: int | None = None,
                             block_n: int | None = None) -> torch.Tensor:
    """Causal attention of S prefill spans in one launch (varlen). Span i's queries are rows
    query_start[i] ... query_start[i+1] - 1 of q [T, Hq, D]; their keys and values are
    already in the cache, at positions context_lens[i] - n_i ... context_lens[i] - 1 of the
    sequence whose blocks block_tables[i] lists (earlier positions are its cached context).
    query_start [S+1], context_lens [S], block_tables [S, W]: int64. Writes those rows of out
    ([T, Hq, D]; other rows are left as they were) and returns it. max_query_len (the
    longest span) sizes the grid; computed from query_start when not given."""
    require_triton()
    _check_cache(kv_cache)
    _check_query(q, kv_cache)
    tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_spans = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check(num_spans >= 0, f"context_lens must be [S], got {tuple(context_lens.shape)}")
    _check_index("context_lens", context_lens, (num_spans,))
    _check_index("query_start", query_start, (num_spans + 1,))
    check(block_tables.dim() == 2, f"block_tables must be [S, W], got {tuple(block_tables.shape)}")
    _check_index("block_tables", block_tables, (num_spans, block_tables.shape[1]))
    out = out_or_new(out, (tokens, num_heads, head_dim), q)
    check_same_device(q=q, kv_cache=kv_cache, query_start=query_start,
                      context_lens=context_lens, block_tables=block_tables, out=out)
    if num_spans == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())
    if max_query_len <= 0:
        return out
    wide = q.dtype != torch.float32 and head_dim <= 128
    block_m = block_m or (64 if wide else 32)
    block_n = block_n or (64 if wide else 32)
    check(block_m >= 16 and block_n >= 16 and block_m == next_pow2(block_m)
          and block_n == next_pow2(block_n), "block_m, block_n: powers of 2, >= 16")
    grid = (num_spans, num_heads, math.ceil(max_query_len / block_m))
    _prefill_kernel[grid](
        q, kv_cache, query_start, context_lens, block_tables, out,
        scale * _LOG2E, num_heads // num_kv_heads, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim),
        QUANT=kv_quant.is_quantized(kv_cache))
    return out


def varlen_prefills(prefills, device: torch.device):
    """PrefillSpan list -> (query_start [S+1], context_lens [S], block_tables [S, W], all
    int64 on `device`; max_query_len). The spans must be consecutive in the batch."""
    for a, b in zip(prefills, prefills[1:]):
        check(b.start == a.start + a.num_tokens,
              f"prefill spans must be consecutive: one ends at {a.start + a.num_tokens}, "
              f"the next starts at {b.start}")
    starts = [p.start for p in prefills] + [prefills[-1].start + prefills[-1].num_tokens]
    tables = torch.nn.utils.rnn.pad_sequence(
        [p.block_table.to(device=device, dtype=torch.int64) for p in prefills],
        batch_first=True)
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor([p.context_len for p in prefills], dtype=torch.int64, device=device),
            tables.contiguous(), max(p.num_tokens for p in prefills))


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, batch, scale: float, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """As attention.paged_attention: writes k, v at batch.slot_mapping, then one decode and
    one varlen prefill launch for the whole batch. Returns [T, Hq, D]. The prefill index
    tensors are built once per batch and kept on it (every layer reuses them)."""
    triton_write_kv(kv_cache, k, v, batch.slot_mapping)
    out = out_or_new(out, q.shape, q)
    nd = batch.num_decode_tokens
    if nd and batch.cascade is not None:      # the shared prefix once (cascade.py)
        out[:nd] = cascade_decode(q[:nd], kv_cache.shape[3], batch.cascade,
                                  lambda q, tables, lens: triton_decode_lse(q, kv_cache, tables,
                                                                            lens, scale))
    elif nd:
        triton_decode_attention(q[:nd], kv_cache, batch.decode_block_tables,
                                batch.decode_context_lens, scale, out=out[:nd])
    if batch.prefills:
        key = f"_triton_varlen:{q.device}"
        varlen = batch.__dict__.get(key)
        if varlen is None:
            varlen = batch.__dict__[key] = varlen_prefills(batch.prefills, q.device)
        starts, lens, tables, max_query_len = varlen
        triton_prefill_attention(q, kv_cache, starts, lens, tables, scale,
                                 max_query_len=max_query_len, out=out)
    return out


def triton_decode_lse(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                      lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the decode kernel: attention over some of the keys, to merge with the
    rest (cascade, context parallelism)."""
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return triton_decode_attention(q, kv_cache, tables, lens, scale, lse=lse), lse
