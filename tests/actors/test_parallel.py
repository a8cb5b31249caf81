"""Tensor-parallel shares: which heads, rows and vocabulary each rank holds, and that the
shares put back together are the whole weights."""
from __future__ import annotations

import pytest
import torch

from pagewire.config import EngineConfig, parse_tcp
from pagewire.executor.models.llama import LlamaConfig
from pagewire.executor.parallel import HeadShare, TensorParallel, shard_state, split_range
from tests.helpers import rank_blocks


def test_split_range_gives_the_first_ranks_one_more():
    assert [split_range(9, 2, r) for r in range(2)] == [(0, 5), (5, 9)]
    assert [split_range(511, 2, r) for r in range(2)] == [(0, 256), (256, 511)]
    assert [split_range(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]


@pytest.mark.parametrize("heads, kv, size, shares", [
    # SmolLM2: 9 query heads in 3 groups of 3; rank 0 takes two KV heads, rank 1 one.
    (9, 3, 2, [HeadShare(0, 6, 0, 2), HeadShare(6, 3, 2, 1)]),
    (4, 2, 2, [HeadShare(0, 2, 0, 1), HeadShare(2, 2, 1, 1)]),
    # Fewer KV heads than ranks: each KV head is replicated, its query group split.
    (2, 1, 2, [HeadShare(0, 1, 0, 1), HeadShare(1, 1, 0, 1)]),
    (8, 2, 4, [HeadShare(0, 2, 0, 1), HeadShare(2, 2, 0, 1), HeadShare(4, 2, 1, 1),
               HeadShare(6, 2, 1, 1)]),
])
def test_head_shares(heads, kv, size, shares):
    assert [TensorParallel(r, size).heads(heads, kv) for r in range(size)] == shares


def test_unsplittable_heads_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="3 query / 1 KV heads cannot be split over 2 ranks"):
        TensorParallel(0, 2).heads(3, 1)


def _fused_state(cfg: LlamaConfig, tied: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    state = {"embed.weight": torch.randn(cfg.vocab_size, h, generator=g),
             "norm.weight": torch.randn(h, generator=g),
             "layers.0.attn.qkv.weight": torch.randn(qkv, h, generator=g),
             "layers.0.attn.qkv.bias": torch.randn(qkv, generator=g),
             "layers.0.attn.o_proj.weight": torch.randn(h, cfg.num_heads * d, generator=g),
             "layers.0.mlp.gate_up.weight": torch.randn(2 * inter, h, generator=g),
             "layers.0.mlp.down.weight": torch.randn(h, inter, generator=g),
             "layers.0.input_norm.weight": torch.randn(h, generator=g)}
    state["lm_head.weight"] = state["embed.weight"] if tied else torch.randn(
        cfg.vocab_size, h, generator=g)
    return state


@pytest.mark.parametrize("heads, kv", [(9, 3), (2, 1), (4, 2)])
def test_shards_put_back_together_are_the_weights(heads, kv):
    cfg = LlamaConfig(vocab_size=511, hidden_size=48, intermediate_size=101, num_layers=1,
                      num_heads=heads, num_kv_heads=kv, head_dim=8)
    state = _fused_state(cfg, tied=True)
    shards = [shard_state(state, cfg, TensorParallel(r, 2)) for r in range(2)]
    d, q_size, kv_size = 8, heads * 8, kv * 8
    for name in ("embed.weight", "lm_head.weight", "layers.0.mlp.down.weight",
                 "layers.0.attn.o_proj.weight", "layers.0.mlp.gate_up.weight"):
        dim = 1 if name.endswith(("down.weight", "o_proj.weight")) else 0
        if name.endswith("gate_up.weight"):
            halves = [s[name].chunk(2) for s in shards]
            whole = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        elif name.endswith("o_proj.weight") and kv < 2:
            whole = torch.cat([s[name] for s in shards], dim=1)   # query heads still partition
        else:
            whole = torch.cat([s[name] for s in shards], dim=dim)
        assert torch.equal(whole, state[name]), name
    for s in shards:
        assert s["lm_head.weight"] is s["embed.weight"]          # tied: one copy per rank
        assert torch.equal(s["norm.weight"], state["norm.weight"])  # replicated
    # QKV: each rank's query rows are its heads' rows; its K/V rows its KV heads'.
    q, k, v = state["layers.0.attn.qkv.weight"].split([q_size, kv_size, kv_size])
    for r, s in enumerate(shards):
        share = TensorParallel(r, 2).heads(heads, kv)
        qs, kvs = share.num_q * d, share.num_kv * d
        sq, sk, sv = s["layers.0.attn.qkv.weight"].split([qs, kvs, kvs])
        assert torch.equal(sq, q[share.q_start * d: share.q_start * d + qs])
        assert torch.equal(sk, k[share.kv_start * d: share.kv_start * d + kvs])
        assert torch.equal(sv, v[share.kv_start * d: share.kv_start * d + kvs])
        assert s["layers.0.attn.qkv.bias"].shape == (qs + 2 * kvs,)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_each_rank_multiplies_its_share_of_the_rounded_blocks(tiny_llama, mode, monkeypatch):
    """--quantization rounds the whole weights, then each rank takes its share of the blocks
    as of the float weights: rows of qkv, gate_up and the LM head, block columns of o_proj
    and down (both aligned here: 320 intermediate rows split 160 + 160)."""
    monkeypatch.setenv("PAGEWIRE_WEIGHT_CACHE", "0")      # throwaway models: no cache files
    path = tiny_llama((128, 4, 2, 64), intermediate_size=320, tie=True)
    for kinds in rank_blocks(path, mode):
        assert set(kinds.values()) == {"blocks"}, kinds


def test_a_share_cut_inside_a_block_keeps_its_float_weights(tiny_llama, monkeypatch):
    """288 intermediate rows split 144 + 144: down's share of columns ends inside a block, so
    down multiplies its float share on each rank; every other linear its blocks."""
    monkeypatch.setenv("PAGEWIRE_WEIGHT_CACHE", "0")      # throwaway models: no cache files
    path = tiny_llama((128, 4, 2, 64))
    for kinds in rank_blocks(path, "int4"):
        assert {n for n, k in kinds.items() if k == "float"} == {"layers.0.mlp.down",
                                                                 "layers.1.mlp.down"}
        assert len(kinds) == 9


@pytest.mark.parametrize("options, message", [
    ({"executors": "external", "tensor_parallel_size": 2}, "needs --listen"),
    ({"executors": "external"}, "needs --tensor-parallel-size 2 or more"),
    ({"listen": "tcp://127.0.0.1:5555"}, "needs --curve-keys"),
    ({"listen": "tcp://*:5555", "curve_keys": "/k"}, "name the address to listen on"),
    ({"tensor_parallel_size": 0}, "at least 1"),
])
def test_parallel_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**options)._check_parallel()


def test_parse_tcp():
    assert parse_tcp("tcp://10.0.0.5:7000") == ("10.0.0.5", 7000)
    assert parse_tcp("tcp://0.0.0.0:7000") == ("0.0.0.0", 7000)
    with pytest.raises(ValueError, match="not tcp://HOST:PORT"):
        parse_tcp("ipc:///tmp/x")


@pytest.mark.parametrize("options, message", [
    ({"tensor_parallel_size": 2}, "each KV head on a multiple of 2 ranks"),        # 2 KV heads
    ({"tensor_parallel_size": 4, "block_size": 1}, "must be a multiple of"),
    ({"tensor_parallel_size": 4, "speculative_config": {"method": "ngram",
                                                        "num_speculative_tokens": 2}},
     "--speculative-config is not built yet"),
])
def test_context_parallel_options_are_checked(tiny_llama, options, message):
    config = EngineConfig.from_options(model=tiny_llama(), max_model_len=128,
                                       decode_context_parallel_size=2, **options)
    with pytest.raises(ValueError, match=message):
        config.resolve()


def test_more_local_ranks_than_gpus_are_refused_at_start(monkeypatch):
    """NCCL takes one rank a GPU: -tp 2 on one GPU failed the first step (seen on an H100)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="a GPU of its own .* and 1 is visible: fewer ranks, or "
                                         "--device cpu"):
        EngineConfig.from_options(tensor_parallel_size=2, device="cuda")._check_parallel()
    EngineConfig.from_options(tensor_parallel_size=2, device="cpu")._check_parallel()
    EngineConfig.from_options(tensor_parallel_size=1, device="cuda")._check_parallel()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    EngineConfig.from_options(tensor_parallel_size=2, device="cuda")._check_parallel()
