"""An encoder's attention (BERT and its kin, executor/models/encoder.py): a flat batch of whole
sequences, each query seeing every key of its own sequence and none of another's; no KV
cache. The native prefill kernel serves it as it serves a vision tower's full_attention
(attention.py): each sequence's keys laid out as cache blocks, its key ends its own end."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      scale: float, lib=None, bias: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """An encoder's attention over a flat batch of sequences: each sequence's queries see all
    and only its own keys (no cache, no causal mask). q, k, v: [T, H, D] (T = sum(seq_lens),
    heads contiguous) -> [T, H, D]. `bias`: added scores [H, L, L] (L >= the longest
    sequence; a sequence of n reads its [:, :n, :n]: MPNet's relative position bias), on
    torch (explicit scores, sequences of one length stacked), never with a window. `window`: a
    query at i sees only keys j with |i - j| <= window (ModernBERT's local layers). On the
    native prefill kernel where it serves (`lib`, as full_attention): one chunk a sequence, its
    keys as cache blocks of 16 (padded), every query's key end its sequence's end (or i +
    window + 1), the kernel's window counting back window + 1 keys; else SDPA, sequences of
    one length stacked into one call."""
    _, h, d = q.shape
    if bias is not None:
        if window is not None:
            raise ValueError("encoder_attention: a bias and a window together are not "
                             "supported")
        return _with_bias(q, k, v, seq_lens, scale, bias)
    if lib is not None and lib.prefill_attention_serves(q, k.new_empty(1, 16, h, d)):
        return _native_encoder_attention(q, k, v, seq_lens, scale, lib, window)
    out = torch.empty_like(q)
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(seq_lens):
        if n:
            by_len.setdefault(n, []).append(starts[i])
    for n, firsts in by_len.items():
        def stack(x):                                            # -> [S, H, n, D]
            return torch.stack([x[s:s + n] for s in firsts]).transpose(1, 2)
        mask = None
        if window is not None:
            pos = torch.arange(n, device=q.device)
            mask = (pos[:, None] - pos[None, :]).abs() <= window
        o = F.scaled_dot_product_attention(stack(q), stack(k), stack(v), attn_mask=mask,
                                           scale=scale).transpose(1, 2)     # [S, n, H, D]
        for i, s in enumerate(firsts):
            out[s:s + n] = o[i]
    return out


def _with_bias(q, k, v, seq_lens: list[int], scale: float, bias: torch.Tensor) -> torch.Tensor:
    """encoder_attention with added scores, spelled out with sequences of one length stacked
    into one product (as the SDPA path): float32 scores and softmax, probabilities in q's
    dtype for the product with V. SDPA with the bias as a float mask took twice as long on the
    CPU. Memory: one [S, H, n, n] float32 score tensor a length (MPNet's n is at most 512)."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    start = 0
    for n in seq_lens:
        if n:
            by_len.setdefault(n, []).append(start)
        start += n
    for n, firsts in by_len.items():
        def stack(x):                                            # -> [S, H, n, D]
            return torch.stack([x[s:s + n] for s in firsts]).transpose(1, 2)
        qs, ks, vs = stack(q), stack(k), stack(v)
        scores = torch.matmul(qs, ks.transpose(-1, -2)).float() * scale + bias[:, :n, :n].float()
        o = torch.matmul(scores.softmax(-1).to(q.dtype), vs).transpose(1, 2)   # [S, n, H, D]
        for i, s in enumerate(firsts):
            out[s:s + n] = o[i]
    return out


def _native_encoder_attention(q, k, v, seq_lens: list[int], scale: float, lib,
                              window: int | None) -> torch.Tensor:
    """encoder_attention on the native prefill kernel: each sequence's keys and values copied
    into its own run of blocks of 16 (the padding never read: key ends stop before it)."""
    t, h, d = q.shape
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    blocks = (lens + 15) // 16
    first_block = torch.cumsum(blocks, 0) - blocks
    starts = torch.cumsum(lens, 0) - lens
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)      # [T]
    offset = torch.arange(t) - starts[seq_of]                                # within its sequence
    slot = first_block[seq_of] * 16 + offset
    total = int(blocks.sum())
    kb = k.new_zeros(total * 16, h, d).index_copy_(0, slot, k).view(total, 16, h, d)
    vb = v.new_zeros(total * 16, h, d).index_copy_(0, slot, v).view(total, 16, h, d)
    chunks = torch.stack([starts, lens, lens, first_block], dim=1).contiguous()
    ends = lens[seq_of]
    if window is not None:
        ends = torch.minimum(ends, offset + window + 1)
    out = q.new_empty(t, h, d)
    lib.prefill_attention(q, kb, vb, chunks, torch.arange(total), scale,
                          None if window is None else window + 1, out, key_ends=ends)
    return out
