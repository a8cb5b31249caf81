"""The CUDA-graph decode path's padding and static buffers, exercised eagerly on CPU: padded
rows must change nothing but the scratch block, and reused buffers must not leak state from
an earlier, larger step. The capture itself runs only where CUDA exists (gpu marker)."""
from __future__ import annotations

import pytest
import torch

from pagewire import LLM
from pagewire.executor.cuda_graphs import DecodeGraphs, capture_sizes
from pagewire.kernels.attention import AttentionBatch


def test_capture_sizes_cover_every_batch_up_to_the_max():
    assert capture_sizes(5) == [1, 2, 4, 5]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [240, 256]
    assert all(b <= min(s for s in sizes if s >= b) for b in range(1, 257))


@pytest.fixture
def runner(tiny_llama):
    llm = LLM(tiny_llama("gqa2-d64"), dtype="float32", block_size=4, num_kv_blocks=64,
              max_model_len=64, max_num_seqs=6)
    runner = llm.runner
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    return runner


def decode_inputs(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 30, (batch,), generator=g)
    width = int(-(-lens.max() // 4))
    tables = torch.randperm(64, generator=g)[:batch * width].view(batch, width)
    slots = tables[torch.arange(batch), (lens - 1) // 4] * 4 + (lens - 1) % 4
    return (torch.randint(3, 500, (batch,), generator=g), lens - 1, slots, tables, lens)


def eager(runner, ids, positions, slots, tables, lens):
    batch = AttentionBatch(slots, len(ids), tables, lens, [])
    return runner.model(ids, positions, runner.kv_caches, batch)


def test_padded_decode_equals_eager_and_touches_only_the_scratch_block(runner):
    graphs = runner.decode_graphs(capture=False)
    assert graphs.sizes == [1, 2, 4, 6] and not graphs.graphs
    inputs = decode_inputs(3, seed=1)
    expected = eager(runner, *inputs)
    before = [c.clone() for c in runner.kv_caches]
    got = graphs.run(*inputs)                       # 3 rows padded to 4
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    scratch = runner.scratch_block
    for old, new in zip(before, runner.kv_caches):
        changed = (old != new).flatten(2).any(-1)    # [2, blocks, slots]
        assert changed.nonzero()[:, 1].unique().tolist() in ([], [scratch])


def test_buffers_reused_by_a_smaller_step_hold_no_stale_rows(runner):
    graphs = runner.decode_graphs(capture=False)
    graphs.run(*decode_inputs(6, seed=2))           # fills every row and a wide table
    small = decode_inputs(2, seed=3)
    torch.testing.assert_close(graphs.run(*small), eager(runner, *small), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_replay_like_eager_on_cuda(tiny_llama):
    llm = LLM(tiny_llama("gqa2-d64"), dtype="float32", block_size=16, num_kv_blocks=64,
              max_model_len=64, max_num_seqs=8, device="cuda")
    graphs = llm.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.sizes
    ids, positions, slots, tables, lens = (t.cuda() for t in decode_inputs(3, seed=4))
    expected = eager(llm.runner, ids, positions, slots, tables, lens)
    torch.testing.assert_close(graphs.run(ids, positions, slots, tables, lens), expected,
                               atol=1e-4, rtol=1e-4)
