"""KV-Compress in the engine (--kv-compress-rate): at rate 1.0 the greedy tokens are those of
the engine without it; at lower rates each compression keeps exactly the layer's share, rows
of a layer keep different counts, and the scheduler frees exactly the blocks the executor
packed its rows out of; what it does not combine with is refused by name."""
from __future__ import annotations

import math
import random

import pytest

from pagewire import LLM, SamplingParams
from pagewire.executor.models.fused_decode import FusedDecode
from pagewire.scheduler import head_tables
from pagewire.scheduler.head_tables import blocks_for

BLOCKS, BS = 256, 16
HKV, LAYERS = 2, 2                     # tiny_llama's gqa2-d64: 2 KV heads, 2 layers


def _prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in lengths]


def _llm(path, kernels="auto", **kw) -> LLM:
    return LLM(path, dtype="float32", num_kv_blocks=BLOCKS, max_model_len=512, kernels=kernels,
               device="cpu", **kw)                     # CPU backends, on a GPU machine too


def _compressing(path, rate, kernels="auto", window=16, **kw) -> LLM:
    return _llm(path, kernels, kv_compress_rate=rate, kv_compress_window=window,
                enable_prefix_caching=False, **kw)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_at_rate_one_the_greedy_tokens_are_those_without_compression(tiny_llama, monkeypatch,
                                                                      kernels):
    path = tiny_llama()
    prompts = _prompts((150, 90, 33, 200, 5))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in _llm(path, kernels).generate(prompts, params)]
    seen = []
    real = head_tables.CompressedTables.compressed
    monkeypatch.setattr(head_tables.CompressedTables, "compressed",
                        lambda self, req, lens: (seen.append(req.num_computed),
                                                 real(self, req, lens)))
    llm = _compressing(path, 1.0, kernels)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    # each at its prompt's end (when it reaches the window of 16), then every 16 tokens
    assert sorted(seen) == sorted([150, 166, 182, 90, 106, 122, 33, 49, 65, 200, 216, 232,
                                   16, 32])
    assert llm.scheduler.kv.num_free == BLOCKS


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_fused_decode_runs_head_rows_to_the_same_tokens(tiny_llama, monkeypatch, kv_dtype):
    """Linears on blocks (--quantization int8): decode steps run fused, over head rows too."""
    path = tiny_llama()
    prompts = _prompts((150, 40, 90), seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(quantization="int8", kv_cache_dtype=kv_dtype)
    plain = [o.outputs[0].token_ids for o in _llm(path, **kw).generate(prompts, params)]
    fused = []
    real = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, **k: (fused.append(self.head_rows),
                                                                    real(self, *a, **k))[1])
    llm = _compressing(path, 1.0, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert len(fused) > 20 and all(fused)
    halved = _compressing(path, 0.5, **kw).generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in halved] == [30] * 3


def test_a_compression_keeps_the_layers_share_and_frees_exactly_the_blocks_left(tiny_llama,
                                                                               monkeypatch):
    llm = _compressing(tiny_llama(), 0.5)
    seen = []
    real = head_tables.CompressedTables.compressed

    def compressed(self, req, lens):
        before = len(req.block_ids)
        real(self, req, lens)
        seq = llm.runner.table.seqs[req.seq_id]           # the executor's side, same step
        seen.append((req.num_computed, lens, before, len(req.block_ids), len(seq.block_ids),
                     self.device.num_free))
    monkeypatch.setattr(head_tables.CompressedTables, "compressed", compressed)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate(_prompts((150,)), params)
    assert [s[0] for s in seen] == [150, 166, 182]
    for n, lens, before, after, executor_blocks, free in seen:
        layers = [lens[i:i + HKV] for i in range(0, len(lens), HKV)]
        assert [sum(layer) for layer in layers] == [HKV * math.ceil(n / 2)] * LAYERS
        assert all(min(layer) >= 16 for layer in layers)           # the protected window
        assert after == executor_blocks == blocks_for(lens, BS)
        assert free == BLOCKS - after
    first = seen[0]
    assert first[2:4] == (10, blocks_for(first[1], BS))            # 150 tokens: 10 blocks
    assert first[3] < first[2]
    assert len({tuple(s[1]) for s in seen}) == 3
    assert any(len(set(layer)) > 1 for layer in (first[1][:HKV], first[1][HKV:]))
    assert llm.scheduler.kv.num_free == BLOCKS


def test_a_requests_own_rate_overrides_the_engines(tiny_llama, monkeypatch):
    llm = _compressing(tiny_llama(), 0.5)
    seen = []
    real = head_tables.CompressedTables.compressed
    monkeypatch.setattr(head_tables.CompressedTables, "compressed",
                        lambda self, req, lens: (seen.append(sum(lens)), real(self, req, lens)))
    llm.generate(_prompts((120,)), SamplingParams(temperature=0, max_tokens=1,
                                                  kv_compress_rate=0.25))
    assert seen == [LAYERS * HKV * 30]


def test_what_kv_compress_does_not_combine_with_is_refused(tiny_llama):
    path = tiny_llama()
    with pytest.raises(ValueError, match="needs --no-enable-prefix-caching"):
        _llm(path, kv_compress_rate=0.5)
    with pytest.raises(ValueError, match="must be in"):
        _compressing(path, 1.5)
    with pytest.raises(ValueError, match="--speculative-config is not supported"):
        _llm(path, kv_compress_rate=0.5, enable_prefix_caching=False,
             speculative_config={"method": "ngram"})
    llm = _compressing(path, 0.5)
    for params in (SamplingParams(n=2), SamplingParams(use_beam_search=True, n=2),
                   SamplingParams(best_of=3)):
        with pytest.raises(ValueError, match="one sequence: n = 1"):
            llm.generate(_prompts((20,)), params)
    with pytest.raises(ValueError, match="start it with --kv-compress-rate"):
        _llm(path).generate(_prompts((20,)), SamplingParams(kv_compress_rate=0.5))
    assert llm.scheduler.kv.num_free == BLOCKS
