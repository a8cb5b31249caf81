"""The CUDA-graph decode path's padding and static buffers, exercised eagerly on CPU: a step
equals the eager forward and writes exactly its rows' cache slots plus, for padded rows, the
scratch block; reused buffers leak no state from an earlier, larger step. The capture itself
runs only where CUDA exists (gpu marker), under the same checks."""
from __future__ import annotations

import os

import pytest
import torch

from pagewire import LLM
from pagewire.executor.cuda_graphs import capture_sizes
from pagewire.executor.lora import LoraBatch
from pagewire.kernels.attention import AttentionBatch
from pagewire.wire.lora import LoraRef
from tests.actors.test_lora import make_adapter


def test_capture_sizes_are_powers_of_two_to_8_then_every_16_and_the_max():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]


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


def written_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[set[int]]:
    """Per layer, the cache slots (block * block_size + offset) whose K or V changed."""
    out = []
    for old, new in zip(before, after):
        changed = (old != new).flatten(3).any(-1).any(0)    # [blocks, block_size]
        out.append(set(changed.flatten().nonzero().flatten().tolist()))
    return out


def run_against_eager(runner, graphs, inputs, tol: float = 1e-5) -> None:
    """One step through `graphs` from the cache as it is, then eagerly from the same cache:
    equal outputs; the step wrote exactly its rows' slots and, where a row was padded in,
    the scratch block's first slot (the caches hold random values, so every write shows);
    both wrote the same K/V to the rows' slots."""
    slots = inputs[2]
    padded = graphs.size_for(len(slots)) > len(slots)
    before = [c.clone() for c in runner.kv_caches]
    got = graphs.run(*inputs)
    after_graphs = [c.clone() for c in runner.kv_caches]
    scratch = {graphs.scratch_block * graphs.block_size} if padded else set()
    assert written_slots(before, after_graphs) == [{*slots.tolist(), *scratch}] * len(before)
    for cache, old in zip(runner.kv_caches, before):
        cache.copy_(old)
    expected = eager(runner, *inputs)
    assert written_slots(before, runner.kv_caches) == [set(slots.tolist())] * len(before)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    pool = slice(0, graphs.scratch_block)                 # every block but the scratch one
    for ours, theirs in zip(after_graphs, runner.kv_caches):
        torch.testing.assert_close(ours[:, pool], theirs[:, pool], atol=tol, rtol=tol)


def test_padded_decode_equals_eager_and_writes_only_its_slots_and_the_scratch_block(runner):
    graphs = runner.decode_graphs(capture=False)
    assert graphs.sizes == [1, 2, 4, 6] and not graphs.graphs
    assert [graphs.size_for(b) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert graphs.scratch_block == 64 and graphs.block_size == 4   # past the 64 pool blocks
    run_against_eager(runner, graphs, decode_inputs(3, seed=1))     # 3 rows padded to 4
    run_against_eager(runner, graphs, decode_inputs(4, seed=5))     # no padding row


def test_buffers_reused_by_a_smaller_step_hold_no_stale_rows(runner):
    """After a step of 6 rows with wide tables, a step of 3 (padded to 4): its padding row
    must not keep the 4th row's token, slot or table from the larger step."""
    graphs = runner.decode_graphs(capture=False)
    big = decode_inputs(6, seed=2)
    graphs.run(*big)                                # fills every row and a wide table
    small = decode_inputs(3, seed=8)                # tables 5 blocks wide, not 7
    assert big[3].shape[1] > small[3].shape[1] and big[2][3] not in small[2]
    run_against_eager(runner, graphs, small)


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
    assert graphs is not None and sorted(graphs.graphs) == graphs.sizes == [1, 2, 4, 8]
    g = torch.Generator().manual_seed(0)
    for cache in llm.runner.kv_caches:             # in place: the graphs hold these addresses
        cache.copy_(torch.randn(cache.shape, generator=g))
    inputs = [t.cuda() for t in decode_inputs(3, seed=4)]         # 3 rows padded to 4
    run_against_eager(llm.runner, graphs, inputs, tol=1e-4)
