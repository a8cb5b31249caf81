"""Cascade attention (kernels/cascade.py): the shared prefix once, each row's suffix, merged by
log-sum-exp, equals every row attending its whole context; the shared prefix found exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.kernels import kv_quant
from pagewire.kernels.attention import (AttentionBatch, Variant, decode_attention,
                                        paged_attention, reference_attention)
from pagewire.kernels.cache import write_kv
from pagewire.kernels.cascade import SharedPrefix, merge_attention, shared_prefix
from pagewire.kernels.ops import select_ops

BS = 16


def _rows(prefix_blocks: int, suffixes: list[int]):
    """Decode rows under one prefix of `prefix_blocks` blocks: row i's context is the prefix
    plus suffixes[i] tokens (its own included). Rows 2-4 are one sequence's successive
    positions (the rows of a step verifying drafts: a chunk of queries)."""
    g = torch.Generator().manual_seed(prefix_blocks * 7 + len(suffixes))
    ids = torch.randperm(64, generator=g)
    prefix, used, tables, lens = ids[:prefix_blocks], prefix_blocks, [], []
    for i, n in enumerate(suffixes):
        if i in (3, 4):                    # the same sequence as row 2, one position on
            tables.append(tables[2])
            lens.append(lens[2] + i - 2)
            continue
        own = -(-(n + 4) // BS)             # room for the chunk's later positions
        tables.append(torch.cat([prefix, ids[used:used + own]]))
        used += own
        lens.append(prefix_blocks * BS + n)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    return table, torch.tensor(lens, dtype=torch.int64)


def _cache(hq_hkv, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv = hq_hkv[1]
    values = torch.randn(2, 64 * BS, hkv, head_dim, generator=g)
    if dtype is None:
        return values.view(2, 64, BS, hkv, head_dim)
    cache = torch.empty(2, 64, BS, hkv, head_dim + kv_quant.SCALE_BYTES, dtype=dtype)
    write_kv(cache, values[0], values[1], torch.arange(64 * BS))
    return cache


def _batch(table, lens, cascade):
    return AttentionBatch(slot_mapping=torch.zeros(0, dtype=torch.int64),
                          num_decode_tokens=len(lens), decode_block_tables=table,
                          decode_context_lens=lens, prefills=[], cascade=cascade)


def _cascade(table, lens, nb) -> SharedPrefix:
    return SharedPrefix(table[0, :nb].clone(), nb * BS, table[:, nb:].contiguous(), lens - nb * BS)


def _attend(ops, q, cache, batch, variant):
    """paged_attention's decode rows, the cache already written (nothing new to write)."""
    return paged_attention(q, q[:0], q[:0], cache, batch, q.shape[-1] ** -0.5,
                           write=lambda *a: None,
                           decode=None if ops.lib is None else ops._decode, variant=variant)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 6), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("prefix_blocks, suffixes", [
    (0, [1, 5, 9, 2, 2, 40]),             # no prefix: the merge with nothing
    (3, [1, 17, 3, 3, 3, 33, 16, 2]),     # one-token suffixes, block-boundary ones, long ones
    (6, [1, 1, 1, 1, 1, 1]),              # the prefix is all but each row's own token(s)
])
def test_prefix_suffix_merge_equals_whole_attention(kernels, heads, head_dim, prefix_blocks,
                                                    suffixes):
    ops = select_ops(torch.device("cpu"), kernels)
    table, lens = _rows(prefix_blocks, suffixes)
    cache = _cache(heads, head_dim, None)
    q = torch.randn(len(lens), heads[0], head_dim, generator=torch.Generator().manual_seed(1))
    plain = _attend(ops, q, cache, _batch(table, lens, None), Variant())
    cascaded = _attend(ops, q, cache, _batch(table, lens, _cascade(table, lens, prefix_blocks)),
                       Variant())
    for b in range(len(lens)):               # the definition, on the row's contiguous context
        blocks = table[b, :-(-int(lens[b]) // BS)]
        keys = cache[0][blocks].flatten(0, 1)[:lens[b]]
        values = cache[1][blocks].flatten(0, 1)[:lens[b]]
        expected = reference_attention(q[b:b + 1], keys, values, head_dim ** -0.5)[0]
        torch.testing.assert_close(cascaded[b], expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cascaded, plain, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_cascade_over_a_quantized_cache_and_capped_scores(kernels, dtype):
    """The prefix's codes dequantized as the decode kernels read them; soft-capping on both
    halves; a sliding-window layer ignores the cascade (its rows attend as without)."""
    ops = select_ops(torch.device("cpu"), kernels)
    table, lens = _rows(4, [1, 6, 2, 2, 2, 30, 17, 9])
    cache = _cache((6, 2), 64, dtype)
    q = torch.randn(len(lens), 6, 64, generator=torch.Generator().manual_seed(2))
    for variant in (Variant(softcap=5.0), Variant(window=40)):
        plain = _attend(ops, q, cache, _batch(table, lens, None), variant)
        cascaded = _attend(ops, q, cache, _batch(table, lens, _cascade(table, lens, 4)), variant)
        torch.testing.assert_close(cascaded, plain, atol=2e-5, rtol=2e-5)


def test_lse_and_merge_are_the_softmax_mass_of_each_half():
    """decode_attention's lse is log sum exp of the row's scores (native and torch agree);
    merging a split of keys gives the unsplit attention."""
    table, lens = _rows(2, [5, 20, 3, 3, 3, 8, 9, 10])
    cache = _cache((4, 2), 64, None)
    q = torch.randn(len(lens), 4, 64, generator=torch.Generator().manual_seed(3))
    out, lse = decode_attention(q, cache, table, lens, 0.125, lse=True)
    native = select_ops(torch.device("cpu"), "cpu")
    if native.lib is not None:
        n_out, n_lse = native._decode(q, cache, table, lens, 0.125, Variant(), lse=True)
        torch.testing.assert_close(n_lse, lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(n_out, out, atol=1e-5, rtol=1e-5)
    keys = cache[0][table[0]].flatten(0, 1)[:lens[0]]                      # [ctx, Hkv, D]
    scores = torch.einsum("hd,khd->hk", q[0], keys.repeat_interleave(2, 1)) * 0.125
    torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1))
    first = decode_attention(q, cache, table[:, :2].contiguous(), torch.full_like(lens, 2 * BS),
                             0.125, lse=True)
    rest = decode_attention(q, cache, table[:, 2:].contiguous(), lens - 2 * BS, 0.125, lse=True)
    merged = merge_attention(torch.stack([first[0], rest[0]]), torch.stack([first[1], rest[1]]))
    torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)


def test_the_shared_prefix_is_the_blocks_every_row_begins_with():
    tables = np.array([[7, 3, 9, 4, 11], [7, 3, 9, 5, 12], [7, 3, 9, 4, 13], [7, 3, 9, 6, 0]])
    context = np.array([5 * BS, 4 * BS + 3, 5 * BS - 1, 4 * BS])
    found = shared_prefix(tables, context, BS, 4, 2 * BS)
    assert found.blocks.tolist() == [7, 3, 9] and found.num_tokens == 3 * BS
    assert found.suffix_tables.tolist() == [[4, 11], [5, 12], [4, 13], [6, 0]]
    assert found.suffix_lens.tolist() == [2 * BS, BS + 3, 2 * BS - 1, BS]
    assert shared_prefix(tables, context, BS, 5, 0) is None      # rows
    assert shared_prefix(tables, context, BS, 4, 3 * BS + 1) is None
    # A row whose last token sits in the third block: that block is its own, not shared.
    short = context.copy()
    short[1] = 2 * BS + 1
    assert shared_prefix(tables, short, BS, 4, 0).blocks.tolist() == [7, 3]
    short[1] = 2 * BS
    assert shared_prefix(tables, short, BS, 4, 0).blocks.tolist() == [7]
    different = tables.copy()
    different[2, 0] = 8
    assert shared_prefix(different, context, BS, 4, 0) is None
