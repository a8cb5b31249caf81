"""Context parallelism's attention (kernels/context_parallel.py): each rank attends its
interleaved share of every context with the backend's decode kernel, and the merge by
log-sum-exp equals one rank attending the whole context."""
from __future__ import annotations

import pytest
import torch

from pagewire.kernels.attention import Variant, decode_attention
from pagewire.kernels.cascade import merge_attention
from pagewire.kernels.context_parallel import local_lengths, local_positions
from pagewire.kernels.ops import select_ops

BS = 16
CONTEXTS = [1, 2, 5, 16, 33, 64, 100, 161]      # short ones leave some ranks nothing


def _whole(contexts, hkv, d, g):
    """Each sequence's keys and values [ctx, Hkv, D], and a paged cache holding them."""
    kv = [(torch.randn(c, hkv, d, generator=g), torch.randn(c, hkv, d, generator=g))
          for c in contexts]
    return kv, _paged(kv, hkv, d)


def _paged(kv, hkv, d):
    """A cache [2, blocks, BS, Hkv, D] with sequence i's tokens in order from block
    tables[i, 0]; (cache, tables [B, W], lens [B])."""
    need = [max(1, -(-len(k) // BS)) for k, _ in kv]
    cache = torch.zeros(2, sum(need), BS, hkv, d)
    tables = torch.zeros(len(kv), max(need), dtype=torch.int64)
    at = 0
    for i, ((k, v), n) in enumerate(zip(kv, need)):
        tables[i, :n] = torch.arange(at, at + n)
        cache[0].view(-1, hkv, d)[at * BS:at * BS + len(k)] = k
        cache[1].view(-1, hkv, d)[at * BS:at * BS + len(v)] = v
        at += n
    return cache, tables, torch.tensor([len(k) for k, _ in kv])


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("hq, hkv, d", [(4, 1, 64), (6, 2, 128), (8, 8, 64)])
def test_ranks_merged_equal_one_rank(kernels, size, hq, hkv, d):
    ops = select_ops(torch.device("cpu"), kernels)
    decode = decode_attention if ops.lib is None else ops._decode     # (q, cache, ..., lse)
    g = torch.Generator().manual_seed(size * 10 + hq)
    kv, (cache, tables, lens) = _whole(CONTEXTS, hkv, d, g)
    q = torch.randn(len(CONTEXTS), hq, d, generator=g)
    whole = decode(q, cache, tables, lens, d ** -0.5, Variant(), False)
    outs, lses = [], []
    for rank in range(size):
        mine = [(k[rank::size], v[rank::size]) for k, v in kv]           # p % size == rank
        local, local_tables, local_lens = _paged(mine, hkv, d)
        assert local_lens.tolist() == local_lengths(lens, rank, size).tolist()
        out, lse = decode(q, local, local_tables, local_lens, d ** -0.5, Variant(), True)
        outs.append(out)
        lses.append(lse)
    merged = merge_attention(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, whole, atol=2e-5, rtol=2e-5)


def test_each_position_lives_on_one_rank_at_its_local_position():
    positions = torch.arange(10)
    assert local_positions(positions, 0, 3).tolist() == [0, -1, -1, 1, -1, -1, 2, -1, -1, 3]
    assert local_positions(positions, 2, 3).tolist() == [-1, -1, 0, -1, -1, 1, -1, -1, 2, -1]
    assert local_lengths(torch.tensor([0, 1, 2, 3, 10]), 1, 3).tolist() == [0, 0, 1, 1, 3]


class _ThreadGroup:
    """all_gather between threads standing in for ranks (a barrier per exchange)."""

    def __init__(self, size: int):
        import threading
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)

    def member(self, rank: int):
        group = self

        class Member:
            def __init__(self):
                self.rank, self.size = rank, group.size

            def all_gather(self, x):
                group.slots[rank] = x.float().clone()
                group.barrier.wait()
                out = torch.stack(group.slots)
                group.barrier.wait()
                return out
        return Member()


# (context once this step's tokens are written, tokens this step): decodes, then prefills
# (a fresh prompt, chunks over cached context, a one-token context).
SEQS = [(1, 1), (2, 1), (37, 1), (64, 1), (19, 19), (50, 7), (70, 45), (3, 2)]


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("size, hq, softcap", [(2, 4, None), (2, 2, 30.0), (4, 8, None)])
def test_context_attention_over_ranks_equals_one_rank(kernels, size, hq, softcap):
    """`size` ranks sharing one KV head, each with hq / size query heads and every size-th
    token in blocks of 16 / size: each rank's output (cache writes included) equals its heads
    of one rank attending whole contexts in blocks of 16."""
    from pagewire.kernels.attention import AttentionBatch, PrefillSpan
    from pagewire.kernels.context_parallel import context_attention, local_batch
    ops = select_ops(torch.device("cpu"), kernels)
    g = torch.Generator().manual_seed(size + hq)
    d, nd = 64, 4
    blocks = [-(-ctx // BS) for ctx, _ in SEQS]
    ids = torch.randperm(sum(blocks) + 2, generator=g)
    tables = list(torch.split(ids[:sum(blocks)], blocks))
    kv = [torch.randn(2, ctx, 1, d, generator=g) for ctx, _ in SEQS]
    q = torch.randn(sum(n for _, n in SEQS), hq, d, generator=g)
    def slots(table, positions):
        return table[positions // BS] * BS + positions % BS
    prior = torch.cat([slots(t, torch.arange(ctx - n)) for t, (ctx, n) in zip(tables, SEQS)])
    prior_kv = torch.cat([x[:, :ctx - n] for x, (ctx, n) in zip(kv, SEQS)], dim=1)
    step = torch.cat([slots(t, torch.arange(ctx - n, ctx)) for t, (ctx, n) in zip(tables, SEQS)])
    k, v = torch.cat([x[:, ctx - n:] for x, (ctx, n) in zip(kv, SEQS)], dim=1)
    table = torch.zeros(nd, max(blocks[:nd]), dtype=torch.int64)
    for i in range(nd):
        table[i, :blocks[i]] = tables[i]
    spans, start = [], nd
    for (ctx, n), t in zip(SEQS[nd:], tables[nd:]):
        spans.append(PrefillSpan(start, n, ctx, t))
        start += n
    batch = AttentionBatch(step, nd, table, torch.tensor([c for c, _ in SEQS[:nd]]), spans)
    whole = torch.zeros(2, len(ids), BS, 1, d)
    ops.write_kv(whole, prior_kv[0], prior_kv[1], prior)
    variant = Variant(softcap=softcap)
    expected = ops.attention(q, k, v, whole, batch, d ** -0.5, variant)

    group, outs = _ThreadGroup(size), [None] * size
    def rank_run(rank):
        cache = torch.zeros(2, len(ids), BS // size, 1, d)
        mine = local_batch(AttentionBatch(prior, 0, None, None, []), rank, size, BS)
        keep = mine.slot_mapping >= 0
        ops.write_kv(cache, prior_kv[0][keep], prior_kv[1][keep], mine.slot_mapping[keep])
        heads = slice(rank * hq // size, (rank + 1) * hq // size)
        outs[rank] = context_attention(ops, group.member(rank), q[:, heads].contiguous(), k, v,
                                       cache, local_batch(batch, rank, size, BS),
                                       d ** -0.5, variant)
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        list(pool.map(rank_run, range(size)))
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, atol=2e-5, rtol=2e-5)
