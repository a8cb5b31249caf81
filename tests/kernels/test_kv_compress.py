"""KV-Compress's kernels (kernels/kv_compress.py) and head rows (executor/head_blocks.py): rows
that evicted nothing attend exactly as the paged cache does; after an eviction a row attends
exactly its kept keys; the attention mass, the choice of kept tokens and the sub-block tables
are exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.executor.decode_layout import decode_tables
from pagewire.executor.head_blocks import Compressor, HeadBlocks
from pagewire.executor.seq_table import SeqState
from pagewire.kernels.attention import (AttentionBatch, PrefillSpan, Variant, causal_mask,
                                        reference_attention)
from pagewire.kernels.kv_compress import attention_mass, choose_kept, compressed_attention
from pagewire.kernels.ops import select_ops
from pagewire.wire.sampling_params import SamplingParams

BS, LAYERS, POOL_BLOCKS = 4, 2, 48


def _seq(prompt: int, computed: int, scheduled: int, blocks: list[int]) -> SeqState:
    return SeqState(list(range(prompt)), prompt, computed, blocks, SamplingParams(), scheduled)


def _paged_batch(order: list[SeqState]) -> AttentionBatch:
    """The step as runner._layout lays it out for the paged cache (decodes first)."""
    slots, prefills, decodes, start = [], [], [], 0
    for seq in order:
        p = np.arange(seq.num_computed, seq.num_computed + seq.num_scheduled)
        blocks = np.asarray(seq.block_ids)
        slots.append(blocks[p // BS] * BS + p % BS)
        end = seq.num_computed + seq.num_scheduled
        if seq.runs_as_decode:
            decodes.append((seq, end))
        else:
            prefills.append(PrefillSpan(start, seq.num_scheduled, end,
                                        torch.from_numpy(blocks[:-(-end // BS)])))
        start += seq.num_scheduled
    return AttentionBatch(torch.from_numpy(np.concatenate(slots)), len(decodes),
                          prefills=prefills, **decode_tables(decodes, BS))


def _caches(hkv: int, d: int, kv_dtype, compressor: Compressor):
    dtype, width = (torch.float32, d) if kv_dtype is None else (kv_dtype, d + 4)
    paged = [torch.zeros(2, POOL_BLOCKS, BS, hkv, width, dtype=dtype) for _ in range(LAYERS)]
    return paged, compressor.allocate(POOL_BLOCKS, width, dtype, torch.device("cpu"))


def _step(ops, order, paged, pool, compressor, hq, hkv, d, gen, variant=Variant()):
    """One step through both layouts, every layer; returns the outputs of each."""
    batch = _paged_batch(order)
    batch.heads = compressor.layout([(None, s) for s in order])
    t = sum(s.num_scheduled for s in order)
    outs = []
    for layer in range(LAYERS):
        q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
        want = ops.attention(q, k, v, paged[layer], batch, d ** -0.5, variant)
        got = compressed_attention(ops, layer, q, k, v, pool, batch, d ** -0.5, variant)
        outs.append((want, got, k, v, q))
    for seq in order:
        seq.num_computed += seq.num_scheduled
    return outs, batch


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (8, 1, 128), (6, 6, 64)])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_rows_that_evicted_nothing_attend_as_the_paged_cache(kernels, hq, hkv, d, kv_dtype):
    ops = select_ops(torch.device("cpu"), kernels)
    gen = torch.Generator().manual_seed(hq * 31 + d)
    compressor = Compressor(LAYERS, hkv, BS, 1.0, 4)
    paged, pool = _caches(hkv, d, kv_dtype, compressor)
    a = _seq(13, 0, 13, [5, 9, 2, 40])             # a whole prompt, then a decode
    b = _seq(12, 0, 7, [11, 3])                    # a prompt in two chunks: 7, then 5
    first, _ = _step(ops, [a, b], paged, pool, compressor, hq, hkv, d, gen)
    a.num_scheduled, b.num_scheduled = 1, 5
    a.token_ids.append(0)
    b.block_ids.append(30)
    c = _seq(6, 0, 6, [17, 18])                    # a fresh prompt beside them
    second, _ = _step(ops, [a, b, c], paged, pool, compressor, hq, hkv, d, gen,
                      Variant(softcap=30.0) if hq == 6 else Variant())
    for want, got, *_ in first + second:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert a.heads.lens.tolist() == [14] * LAYERS * hkv
    assert b.heads.counts.tolist() == [3] * LAYERS * hkv


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_after_an_eviction_a_row_attends_exactly_its_kept_keys(kernels):
    ops = select_ops(torch.device("cpu"), kernels)
    hq, hkv, d = 4, 2, 64
    gen = torch.Generator().manual_seed(5)
    compressor = Compressor(LAYERS, hkv, BS, 0.5, 3)
    paged, pool = _caches(hkv, d, None, compressor)
    a = _seq(22, 0, 22, [7, 1, 12, 30, 4, 9])
    (steps, _) = _step(ops, [a], paged, pool, compressor, hq, hkv, d, gen)
    keys = [k for _, _, k, _, _ in steps]          # [22, Hkv, D] a layer
    values = [v for _, _, _, v, _ in steps]
    mass = torch.rand(LAYERS * hkv, 24, generator=gen)
    lens = torch.from_numpy(a.heads.lens)
    kept = [k.numpy() for layer in range(LAYERS) for k in
            choose_kept(mass[layer * hkv:(layer + 1) * hkv], lens[:hkv], 11, 3)]
    keep = a.heads.pack(kept, pool)
    del a.block_ids[keep:]
    assert [len(k) for k in kept] != [11] * (LAYERS * hkv)        # rows differ, layers sum
    assert [sum(len(k) for k in kept[i:i + hkv]) for i in (0, hkv)] == [22, 22]
    a.num_scheduled = 1
    a.token_ids.append(0)
    batch = AttentionBatch(torch.zeros(0, dtype=torch.int64), 1, None, None, prefills=[])
    batch.heads = compressor.layout([(None, a)])
    for layer in range(LAYERS):
        q, k, v = (torch.randn(1, h, d, generator=gen) for h in (hq, hkv, hkv))
        got = compressed_attention(ops, layer, q, k, v, pool, batch, d ** -0.5)
        for h in range(hkv):
            index = torch.from_numpy(kept[layer * hkv + h])
            ks = torch.cat([keys[layer][index, h], k[:, h]])[:, None]        # [n, 1, D]
            vs = torch.cat([values[layer][index, h], v[:, h]])[:, None]
            want = reference_attention(q[:, h * 2:h * 2 + 2], ks, vs, d ** -0.5)
            torch.testing.assert_close(got[:, h * 2:h * 2 + 2], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_mass_sums_the_latest_queries_attention_causally(dtype):
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d, w = 4, 2, 16, 3
    pool = torch.randn(2, 12, BS, 1, d, generator=gen).to(dtype)
    tables = torch.tensor([[4, 0, 7], [2, 11, 5]])
    lens = torch.tensor([10, 7])
    q = torch.randn(w, hq, d, generator=gen).to(dtype)
    mass = attention_mass(q, pool, tables, lens, 0.25)
    for h in range(hkv):
        n = int(lens[h])
        keys = pool[0][tables[h]].reshape(-1, d)[:n].float()
        scores = torch.einsum("whd,kd->hwk", q[:, 2 * h:2 * h + 2].float(), keys) * 0.25
        scores = scores.masked_fill(~causal_mask(w, n, q.device), float("-inf"))
        want = scores.softmax(-1).sum((0, 1))
        torch.testing.assert_close(mass[h, :n], want)
        assert mass[h, n:].abs().sum() == 0
    assert torch.allclose(mass.sum(1), torch.full((hkv,), 2.0 * w))


def test_choose_kept_keeps_the_window_then_the_layers_most_attended_tokens():
    mass = torch.tensor([[0.9, 0.1, 0.8, 0.2, 0.0, 0.0, 5.0, 5.0],
                         [0.3, 0.7, 0.6, 0.05, 0.4, 0.0, 0.0, 0.0]])
    lens = torch.tensor([8, 5])
    kept = choose_kept(mass, lens, 4, 2)    # 8 kept: windows 6,7 and 3,4; then 4 of the rest
    assert [k.tolist() for k in kept] == [[0, 2, 6, 7], [1, 2, 3, 4]]
    everything = choose_kept(mass, lens, 7, 2)
    assert [k.tolist() for k in everything] == [list(range(8)), list(range(5))]
    only_windows = choose_kept(mass, lens, 1, 2)
    assert [k.tolist() for k in only_windows] == [[6, 7], [3, 4]]


def test_head_rows_take_sub_blocks_in_table_order_and_pack_into_the_first_blocks():
    rows, bs = 4, 2
    heads = HeadBlocks(rows, bs)
    heads.sync([7, 3])                              # sub-blocks 28..31, then 12..15
    slots = heads.reserve(3)                        # 2 sub-blocks a row
    assert heads.table[:, :2].tolist() == [[28, 29], [30, 31], [12, 13], [14, 15]]
    assert slots[1].tolist() == [60, 61, 62]
    heads.sync([7, 3, 5])
    heads.reserve(2)                                # rows reach 5 tokens: a third sub-block
    assert heads.table[:, 2].tolist() == [20, 21, 22, 23]
    pool = torch.arange(2 * 9 * rows * bs, dtype=torch.float32).view(2, 9 * rows, bs, 1, 1)
    before = pool.clone().view(2, -1)
    kept = [np.array([0, 4]), np.array([1]), np.array([0, 1, 2, 3, 4]), np.array([2])]
    assert heads.pack(kept, pool) == 2               # 1 + 1 + 3 + 1 sub-blocks: 2 blocks
    assert heads.lens.tolist() == [2, 1, 5, 1]
    assert heads.blocks == [7, 3]
    # row 2's third sub-block (22, in block 5) moved into a free one of blocks 7, 3
    assert [heads.table[i, :c].tolist() for i, c in enumerate(heads.counts)] == \
        [[28], [30], [12, 13, 15], [14]]
    flat = pool.view(2, -1)
    assert flat[0, [56, 57]].tolist() == before[0, [56, 40]].tolist()     # row 0: 0 and 4
    assert flat[1, 60].item() == before[1, 61].item()                    # row 1: 1
    assert flat[0, [24, 25, 26, 27, 30]].tolist() == \
        before[0, [24, 25, 26, 27, 44]].tolist()                        # row 2: all, 4 moved
    assert flat[1, 28].item() == before[1, 30].item()                    # row 3: 2
    assert heads.free == [31, 29]                                        # pop(): 29 next
