"""What `--kv-cache-memory auto` and `--quantized-matmul-tokens auto` take (memory_budget.py,
executor/linear_blocks.py DenseRoom), from given amounts of free memory."""
from __future__ import annotations

import msgspec
import pytest
import torch

from pagewire import memory_budget
from pagewire.executor.linear_blocks import AUTO_MATMUL_TOKENS, DenseRoom
from pagewire.kernels import native, quant
from pagewire.model_info import ModelInfo

GiB = 2**30


@pytest.fixture
def info(tmp_path) -> ModelInfo:
    """An 8B-shaped GGUF's description over a file of 1 GiB (sparse: its size is all that is
    read)."""
    path = tmp_path / "m.gguf"
    with open(path, "wb") as f:
        f.truncate(GiB)
    return ModelInfo(path=str(path), format="gguf", name="m", architecture="LlamaForCausalLM",
                     max_model_len=32768, vocab_size=49152, num_layers=32, num_kv_heads=8,
                     head_dim=128, eos_token_ids=[2], digest="d", hidden_size=4096,
                     num_heads=32, intermediate_size=14336)


PER_TOKEN = 128 * 1024          # 8B's K/V a token in bfloat16


def test_auto_takes_half_of_what_the_weights_leave(info):
    plan = memory_budget.kv_auto(info, PER_TOKEN, 32768, False, 256, -1, free=20 * GiB)
    weights = int(GiB * memory_budget.TILE_OVERHEAD)
    assert plan.bytes == (20 * GiB - weights - memory_budget.RESERVE) // 2
    assert plan.max_len == 32768 and "20.0 GiB free" in plan.reason


def test_auto_is_no_more_than_the_sequences_fill(info):
    plan = memory_budget.kv_auto(info, PER_TOKEN, 4096, True, 4, -1, free=20 * GiB)
    assert plan.bytes == 4 * 4096 * PER_TOKEN


def test_a_dense_copy_asked_for_counts_against_the_pool(info):
    """--quantized-matmul-tokens 16 holds a bfloat16 copy of every linear beside the blocks:
    2 bytes a weight less to share, so the pool is one byte a weight smaller."""
    weights = 32 * (4096 * (4096 + 2048) + 4096 * 4096 + 3 * 4096 * 14336) + 4096 * 49152
    blocks = memory_budget.kv_auto(info, PER_TOKEN, 1024, True, 4096, -1, free=40 * GiB)
    dense = memory_budget.kv_auto(info, PER_TOKEN, 1024, True, 4096, 16, free=40 * GiB)
    assert abs(blocks.bytes - dense.bytes - weights) <= 1


def test_a_context_not_given_is_lowered_to_fit(info):
    plan = memory_budget.kv_auto(info, PER_TOKEN, 32768, False, 256, -1, free=4 * GiB)
    share = (4 * GiB - int(GiB * memory_budget.TILE_OVERHEAD) - memory_budget.RESERVE) // 2
    assert plan == (share, share // PER_TOKEN, plan.reason)
    assert f"lowered to {share // PER_TOKEN} tokens" in plan.reason


def test_a_context_given_gets_one_sequence_however_little_is_free(info):
    plan = memory_budget.kv_auto(info, PER_TOKEN, 32768, True, 256, -1, free=4 * GiB)
    assert (plan.bytes, plan.max_len) == (32768 * PER_TOKEN, 32768)
    assert "exactly one" in plan.reason


def test_dense_room_gives_copies_until_they_no_longer_fit():
    lib = native.load()
    if lib is None or not quant.available(lib):
        pytest.skip("no native quantized matmuls here")
    raw = torch.zeros(32, 64 // 32 * 34, dtype=torch.uint8)            # Q8_0 [32, 64]
    weight = quant.pack(quant.Q8_0, raw, 64, lib)
    room = DenseRoom(2 * 32 * 64 * 2, lib, False, 2)                   # two bfloat16 copies
    assert [room.tokens(weight) for _ in range(3)] == [AUTO_MATMUL_TOKENS] * 2 + [-1]
    assert (room.taken, room.refused) == (2 * 32 * 64 * 2, 32 * 64 * 2)
    unbounded = DenseRoom(None, lib, False, 4)
    assert {unbounded.tokens(weight) for _ in range(5)} == {AUTO_MATMUL_TOKENS}


@pytest.mark.parametrize("free_gib", [3.0, 1.4])
def test_resolve_sizes_the_pool_from_free_memory(monkeypatch, free_gib):
    """The default model resolved with everything default: its pool is kv_auto's for the
    memory free, in whole blocks; with 1.4 GiB free its 8,192-token context is lowered to what
    the pool holds."""
    from pagewire.config import EngineConfig
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: int(free_gib * GiB))
    config = EngineConfig.from_options().resolve()
    info, block = config.model.model_info, config.cache.kv_block_bytes
    per_token = block // config.cache.block_size
    share = int((free_gib * GiB - memory_budget.weights_estimate(info, -1)
                 - memory_budget.RESERVE) * memory_budget.KV_SHARE)
    assert config.cache.num_kv_blocks == share // block
    lowered = share // per_token < info.max_model_len
    assert lowered == (free_gib == 1.4)
    assert config.model.max_model_len == \
        (share // per_token // 16 * 16 if lowered else info.max_model_len)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K",
                                   "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4"])
def test_tile_bytes_are_what_pack_makes(native_lib, qtype):
    """The estimate's bytes a 32 weights of each type are the tiles' (kernels/quant.py)."""
    import gguf
    import numpy as np

    from pagewire.kernels import gguf_blocks
    from pagewire.testing.gguf_writer import random_blocks
    kind = int(gguf.GGMLQuantizationType[qtype])
    raw = random_blocks(qtype, 16, 512, np.random.default_rng(0))
    if kind in gguf_blocks.SUPERBLOCKS:
        kind, raw = gguf_blocks.k_quant_super_blocks(kind, raw)
    weight = quant.pack(kind, raw, 512, native_lib)
    assert weight.nbytes / (16 * 512 / 32) == memory_budget.tile_bytes(level_tiles=True)[
        int(gguf.GGMLQuantizationType[qtype])]


def test_a_gguf_files_weights_are_counted_by_type(tmp_path, info):
    """A GGUF file's linears as their tiles hold them, the embedding as its blocks (Q4_K: 144
    bytes a 256 weights), the norms dequantized."""
    import gguf
    import numpy as np

    from pagewire.testing.gguf_writer import quantize_q4_k
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w = np.zeros((32, 512), dtype=np.float32)
    q4_k = gguf.GGMLQuantizationType.Q4_K
    writer.add_tensor("blk.0.attn_q.weight", quantize_q4_k(w), raw_dtype=q4_k)
    writer.add_tensor("token_embd.weight", quantize_q4_k(w), raw_dtype=q4_k)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(512, dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    gguf_info = msgspec.structs.replace(info, path=str(tmp_path / "t.gguf"))
    assert memory_budget.weights_estimate(gguf_info, -1) == \
        32 * 512 // 32 * 18.5 + 32 * 512 // 256 * 144 + 512 * 2


def test_block_embedding_types_are_those_torch_dequantizes():
    from pagewire.executor.gguf_weights import DEQUANTIZED
    assert memory_budget.BLOCK_EMBEDDINGS == set(DEQUANTIZED)


@pytest.mark.parametrize("level_tiles", [True, False])
def test_an_mxfp4_checkpoint_counts_its_blocks_as_its_tiles(tmp_path, info, monkeypatch,
                                                            level_tiles):
    """gpt-oss's MXFP4 experts: 17 bytes a 32 weights on disk; 18 as level tiles hold them
    (every native tier), 34 as Q8_0 tiles (where a tier lacks them)."""
    monkeypatch.setattr(memory_budget, "_level_tiles", lambda: level_tiles)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(17 * GiB // 16)
    mxfp4 = msgspec.structs.replace(info, path=str(tmp_path), format="hf",
                                    stored_quantization="mxfp4")
    assert memory_budget.weights_estimate(mxfp4, -1) == (18 if level_tiles else 34) * GiB // 16
    assert memory_budget.tile_bytes(level_tiles)[39] == (18 if level_tiles else 2 * 17)
