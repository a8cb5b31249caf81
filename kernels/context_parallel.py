"""Context parallelism (vLLM's decode context parallel), its attention: each of `size` ranks
holds every `size`-th token of every sequence's KV — position p on rank p % size, at local
position p // size — so a context `size` times longer than one rank's KV fits. A query
attends its rank's tokens with the backend's own decode kernel (which returns the
log-sum-exp), and the ranks' partial outputs merge by log-sum-exp into the attention over
the whole context.

The scheduler's blocks hold block_size tokens; each rank's copy of a block holds its
block_size / size of them (local_batch). The ranks of a group are tensor-parallel ranks that
share one KV head (each computes that head's keys and values; each stores only its tokens)
and hold consecutive query heads: every rank's queries are gathered so each attends its
tokens for the whole group, the partial outputs gathered back and merged, and each rank keeps
its own heads (context_attention). Prefill rows attend their local keys under a mask by
global position, in torch.
"""
from __future__ import annotations

import torch

from . import kv_quant
from .attention import AttentionBatch, PrefillSpan, Variant
from .cascade import merge_attention


def local_lengths(context_lens, rank: int, size: int):
    """Tokens of each context (an int, or a tensor of them) that `rank` holds: positions
    p < ctx with p % size == rank."""
    return (context_lens - rank + size - 1) // size


def local_positions(positions: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Where `rank` keeps each position (its local position), or -1 where another rank
    holds it: the slots a rank writes this step's keys and values to."""
    return torch.where(positions % size == rank, positions.div(size, rounding_mode="floor"),
                       torch.full_like(positions, -1))




def local_batch(batch: AttentionBatch, rank: int, size: int, block_size: int) -> AttentionBatch:
    """The step's batch as `rank` sees it: its slots (-1 for another rank's tokens) in blocks
    of block_size / size, and its share of each decode row's context. Prefill spans keep
    their global context lengths: their attention masks by global position."""
    local_bs = block_size // size
    block, offset = batch.slot_mapping // block_size, batch.slot_mapping % block_size
    local = local_positions(offset, rank, size)            # within the block; -1: not its
    slots = torch.where(local >= 0, block * local_bs + local, local)
    lens = batch.decode_context_lens
    return AttentionBatch(slots, batch.num_decode_tokens, batch.decode_block_tables,
                          None if lens is None else local_lengths(lens, rank, size),
                          batch.prefills)


def context_attention(ops, cp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, batch: AttentionBatch, scale: float,
                      variant: Variant) -> torch.Tensor:
    """This rank's attention output [T, Hq, D] under context parallelism: `cp` (rank, size,
    all_gather(x) -> [S, *x.shape]) is its group, `batch` its local_batch. The backend `ops`
    writes this rank's keys and values and runs the decode rows (decode_lse)."""
    keep = batch.slot_mapping >= 0
    if keep.any():                     # a decode step may bring none of this rank's tokens
        ops.write_kv(kv_cache, k[keep], v[keep], batch.slot_mapping[keep])
    t, heads, d = q.shape
    every = cp.all_gather(q).transpose(0, 1).reshape(t, cp.size * heads, d).to(q.dtype)
    out = torch.empty(t, cp.size * heads, d, device=q.device)              # the group's heads
    lse = torch.empty(t, cp.size * heads, device=q.device)
    nd = batch.num_decode_tokens
    if nd:
        out[:nd], lse[:nd] = ops.decode_lse(every[:nd].contiguous(), kv_cache,
                                            batch.decode_block_tables, batch.decode_context_lens,
                                            scale, variant)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        out[rows], lse[rows] = _local_prefill(every[rows], kv_cache, span, cp.rank, cp.size,
                                              scale, variant.softcap)
    merged = merge_attention(cp.all_gather(out), cp.all_gather(lse))       # [T, S Hq, D]
    return merged[:, cp.rank * heads:(cp.rank + 1) * heads].to(q.dtype)


def _local_prefill(q: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan, rank: int,
                   size: int, scale: float, softcap: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill span's queries [n, H, D] over this rank's keys at or before each query's
    position -> (out [n, H, D], lse [n, H]) float32; a query that sees none of them gets
    lse -inf (merge_attention weighs it nothing)."""
    n, heads, _ = q.shape
    count = local_lengths(span.context_len, rank, size)
    def rows(cache):                                                       # [L, Hkv, D]
        return kv_quant.readable(cache[span.block_table], torch.float32).flatten(0, 1)[:count]
    keys, values = rows(kv_cache[0]), rows(kv_cache[1])
    group = heads // keys.shape[1]
    key_pos = torch.arange(count, device=q.device) * size + rank
    query_pos = torch.arange(span.context_len - n, span.context_len, device=q.device)
    scores = torch.einsum("qhd,khd->hqk", q.float(),
                          keys.repeat_interleave(group, 1)) * scale        # [H, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)                                      # [H, n]
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]),
                       values.repeat_interleave(group, 1))
    return out, lse.T
