"""The CUDA-graph decode path's padding and static buffers, exercised eagerly on CPU: padded
rows must change nothing but the scratch block, and reused buffers must not leak state from
an earlier, larger step. The capture itself runs only where CUDA exists (gpu marker)."""
from __future__ import annotations

import os

import pytest
import torch

from pagewire import LLM
from pagewire.executor.cuda_graphs import DecodeGraphs, capture_sizes
from pagewire.executor.lora import LoraBatch
from pagewire.kernels.attention import AttentionBatch
from pagewire.wire.lora import LoraRef
from tests.actors.test_lora import make_adapter


def test_capture_sizes_cover_every_batch_up_to_the_max():
    assert capture_sizes(5) == [1, 2, 4, 5]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [240, 256]
    assert all(b <= min(s for s in sizes if s >= b) for b in range(1, 257))


@pytest.fixture
def runner(tiny_llama):
    llm = LLM(tiny_llama("gqa2-d64"), dtype="float32", block_size=4, num_kv_blocks=64,
              max_model_len=64, max_num_seqs=6, device="cpu")
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


def eager(runner, ids, positions, slots, tables, lens, lora=None):
    batch = AttentionBatch(slots, len(ids), tables, lens, [])
    return runner.model(ids, positions, runner.kv_caches, batch, lora)


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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
def test_adapter_steps_run_the_graphs_through_static_lora_inputs(tiny_llama, tmp_path):
    """With adapters on the Triton backend (here under its interpreter, eagerly) the graphs'
    LoRA inputs sit at fixed addresses: each step copies its rows' adapter indices, and its
    adapters' weights only when they differ from the last step's (steady decoding copies
    none). Each step equals the eager forward with the same adapters."""
    base = tiny_llama("gqa2-d64")
    paths = [make_adapter(str(tmp_path / "a"), base, rank=4, seed=1),
             make_adapter(str(tmp_path / "b"), base, ("q_proj", "v_proj", "down_proj"), rank=8,
                          seed=2)]
    llm = LLM(base, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              max_num_seqs=6, device="cpu", kernels="triton", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    runner, graphs = llm.runner, llm.runner.decode_graphs(capture=False)
    loaded = [runner.adapters.get(LoraRef(n, i, p)) for i, (n, p) in enumerate(zip("ab", paths))]

    def lora(which: list[int], of_row: list[int]) -> LoraBatch:
        adapters = [loaded[i] for i in which]
        return LoraBatch(torch.tensor(of_row), adapters, runner.adapters.stacks_for(adapters))
    steps = [(lora([0], [0, -1, 0]), (0,)), (lora([0], [-1, 0, 0, 0]), (0,)),
             (lora([1, 0], [0, 1, -1, 1, 0]), (1, 0)), (None, (1, 0)), (lora([1], [0, -1]), (1,))]
    for seed, (step_lora, weights_in) in enumerate(steps):
        n = 3 if step_lora is None else len(step_lora.adapter_of_row)
        inputs = decode_inputs(n, seed=20 + seed)
        expected = eager(runner, *inputs, step_lora)
        torch.testing.assert_close(graphs.run(*inputs, step_lora), expected, atol=1e-5,
                                   rtol=1e-5)
        assert graphs.lora.key == tuple(loaded[i].generation for i in weights_in)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_replay_like_eager_on_cuda(tiny_llama):
    llm = LLM(tiny_llama("gqa2-d64"), dtype="float32", block_size=4, num_kv_blocks=64,
              max_model_len=64, max_num_seqs=8, device="cuda")   # decode_inputs' block size
    graphs = llm.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.sizes
    ids, positions, slots, tables, lens = (t.cuda() for t in decode_inputs(3, seed=4))
    expected = eager(llm.runner, ids, positions, slots, tables, lens)
    torch.testing.assert_close(graphs.run(ids, positions, slots, tables, lens), expected,
                               atol=1e-4, rtol=1e-4)
