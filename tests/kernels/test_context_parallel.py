"""Context parallelism's attention (kernels/context_parallel.py): each rank attends its
interleaved share of every context with the backend's decode kernel, and the merge by
log-sum-exp equals one rank attending the whole context."""
from __future__ import annotations

import pytest
import torch

from pagewire.kernels.attention import Variant, decode_attention
from pagewire.kernels.context_parallel import local_lengths, local_positions, merge_ranks
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
    merged = merge_ranks(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, whole, atol=2e-5, rtol=2e-5)


def test_each_position_lives_on_one_rank_at_its_local_position():
    positions = torch.arange(10)
    assert local_positions(positions, 0, 3).tolist() == [0, -1, -1, 1, -1, -1, 2, -1, -1, 3]
    assert local_positions(positions, 2, 3).tolist() == [-1, -1, 0, -1, -1, 1, -1, -1, 2, -1]
    assert local_lengths(torch.tensor([0, 1, 2, 3, 10]), 1, 3).tolist() == [0, 0, 1, 1, 3]
