"""Triton bidirectional variable-length attention for encoder-only models (BERT and kin): a
flat batch of sequences, each query seeing every key of its own sequence and none of another's,
no KV cache (q, k, v as the layer computed them). The torch reference is
kernels/attention.encoder_attention's; TritonOps.encoder_attention launches this. Softmax is
online, in base 2, accumulated in float32, as in attention_triton.py."""
from __future__ import annotations

import math

import torch

from ._triton import (HAS_TRITON, check, check_float, check_same_device, next_pow2,
                      out_or_new, require_triton, tl, triton)

_LOG2E = 1.4426950408889634

if HAS_TRITON:
    @triton.jit
    def _encoder_kernel(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, qk_scale, group, head_dim,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_ot, stride_oh,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (sequence, query head, query tile): BLOCK_M of the sequence's n queries
        against all its n keys."""
        seq = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        m0 = tl.program_id(2) * BLOCK_M
        first = tl.load(starts_ptr + seq)
        n = tl.load(starts_ptr + seq + 1) - first
        if m0 < n:
            kvh = h // group
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < n
            dims = tl.arange(0, BLOCK_D)
            d_mask = dims < head_dim
            q = tl.load(q_ptr + (first + rows)[:, None] * stride_qt + h * stride_qh
                        + dims[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
            m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)   # finite: no NaN
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for n0 in range(0, n, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                c_mask = cols < n
                kv_mask = c_mask[:, None] & d_mask[None, :]
                k = tl.load(k_ptr + (first + cols)[:, None] * stride_kt + kvh * stride_kh
                            + dims[None, :], mask=kv_mask, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale      # [M, N]
                s = tl.where(c_mask[None, :], s, -1.0e30)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + (first + cols)[:, None] * stride_vt + kvh * stride_vh
                            + dims[None, :], mask=kv_mask, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                m_i = m_new
            tl.store(out_ptr + (first + rows)[:, None] * stride_ot + h * stride_oh
                     + dims[None, :], acc / l_i[:, None], mask=r_mask[:, None] & d_mask[None, :])


def triton_encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             seq_lens: list[int], scale: float, *,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], k, v [T, Hkv, D] (T = sum(seq_lens); Hq a multiple of Hkv; the last
    dimension contiguous) -> out [T, Hq, D]: each sequence's queries over its own keys."""
    require_triton()
    check(q.dim() == 3 and k.dim() == 3 and v.shape == k.shape,
          f"q [T, Hq, D], k and v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
          f"{tuple(v.shape)}")
    tokens, num_heads, head_dim = q.shape
    check(k.shape[0] == tokens and k.shape[2] == head_dim and num_heads % k.shape[1] == 0,
          f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(sum(seq_lens) == tokens and min(seq_lens, default=1) > 0,
          f"seq_lens (positive, summing to {tokens}) got {list(seq_lens)[:8]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t, None if name == "q" else q.dtype)
        check(t.stride(2) == 1, f"{name}: the head dimension must be contiguous")
    out = out_or_new(out, q.shape, q)
    check_same_device(q=q, k=k, v=v, out=out)
    if tokens == 0:
        return out
    starts = torch.tensor([0, *seq_lens], device=q.device).cumsum(0)
    wide = q.dtype != torch.float32 and head_dim <= 128
    block_m = block_n = 64 if wide else 32
    grid = (len(seq_lens), num_heads, math.ceil(max(seq_lens) / block_m))
    _encoder_kernel[grid](
        q, k, v, out, starts, scale * _LOG2E, num_heads // k.shape[1], head_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim))
    return out
