"""--kv-cache-dtype int8 / fp8 end to end in the offline engine on a tiny random-weight model:
capacity, outputs that do not depend on prefix hits, chunking, preemption or the backend, and
next-token distributions close to the unquantized cache's."""
from __future__ import annotations

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.config import EngineConfig
from tests.actors.test_engine_sharing import assert_pool_whole, prompts, tokens

QUANTIZED = ["int8", "fp8", "fp8_e5m2"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory, smol_tokenizer_dir):
    from tests.helpers import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("m")), smol_tokenizer_dir, "gqa2-d64")


def test_a_quantized_cache_holds_more_blocks_in_the_same_memory(model):
    def blocks(kv_dtype, dtype="bfloat16"):
        return EngineConfig.from_options(model=model, dtype=dtype, kv_cache_memory=1 << 20,
                                         max_model_len=256, kv_cache_dtype=kv_dtype
                                         ).resolve().cache.num_kv_blocks
    # A token in each of 2 layers x 2 kv heads x (keys, values): 64 values of 2 bytes, or
    # 64 one-byte codes and a 4-byte scale. Blocks of 16 tokens.
    assert blocks("auto") == (1 << 20) // (16 * 8 * 64 * 2) == 64
    assert blocks("int8") == blocks("fp8") == (1 << 20) // (16 * 8 * 68) == 120      # 1.88x
    assert blocks("auto", "float32") == 32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        blocks("int4")


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_outputs_do_not_depend_on_prefix_hits_or_chunking(model, kv_dtype):
    """A quantized cache is always read (attention.py): a prefix hit, a recompute and a
    prompt chunked in pieces attend the same stored keys and values."""
    shared = prompts(2, [40])[0]
    batch = [shared + tail for tail in prompts(3, [3, 9, 17])]
    kw = dict(dtype="float32", block_size=8, num_kv_blocks=256, kv_cache_dtype=kv_dtype)
    on = LLM(model, **kw)
    first = on.generate([{"prompt_token_ids": batch[0]}], GREEDY)
    rest = on.generate([{"prompt_token_ids": p} for p in batch[1:]], GREEDY)
    assert on.scheduler.tables.prefix_hits == 2 * 40
    off = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=16, **kw)
    expected = off.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    assert tokens(first + rest) == tokens(expected)
    assert_pool_whole(on)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_outputs(model, mode):
    ps = prompts(4, [30, 31, 29, 30])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model, dtype="float32", block_size=4, num_kv_blocks=256, kv_cache_dtype="int8")
    expected = roomy.generate([{"prompt_token_ids": p} for p in ps], params)
    tight = LLM(model, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=128,
                swap_space=1 << 20, preemption_mode=mode, kv_cache_dtype="int8")
    outs = tight.generate([{"prompt_token_ids": p} for p in ps], params)
    assert tight.scheduler.num_preemptions > 0
    assert tokens(outs) == tokens(expected)
    assert_pool_whole(tight)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_native_and_torch_backends_agree(model, kv_dtype):
    """The native write and decode (the fused decode path among them) against the torch
    reference, greedy."""
    ps = [{"prompt_token_ids": p} for p in prompts(6, [5, 23, 40])]
    outs = {}
    for kernels in ("auto", "torch"):
        llm = LLM(model, dtype="float32", block_size=16, num_kv_blocks=64, kernels=kernels,
                  kv_cache_dtype=kv_dtype)
        outs[kernels] = tokens(llm.generate(ps, GREEDY))
    assert outs["auto"] == outs["torch"]


def _prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Each position's log-probability of the next token given (teacher-forced), [n - 1]."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    return torch.tensor([t.logprob for t in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("kv_dtype, mean, most", [("int8", 0.02, 0.06), ("fp8", 0.06, 0.25),
                                                  ("fp8_e5m2", 0.12, 0.5)])
def test_next_token_probabilities_stay_close(model, kv_dtype, mean, most):
    """Each position's log-probability of the next token, quantized cache against float32,
    within bounds per dtype (measured 0.008 / 0.03, 0.03 / 0.11, 0.06 / 0.23 mean / max on
    this random-weight model, whose attention is far from peaked; a scale lost or misplaced
    moves them by whole units)."""
    ids = prompts(7, [120])[0]
    kw = dict(dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=16)
    exact = _prompt_logprobs(LLM(model, **kw), ids)
    quant = _prompt_logprobs(LLM(model, kv_cache_dtype=kv_dtype, **kw), ids)
    diff = (quant - exact).abs()
    assert diff.mean() < mean and diff.max() < most, (float(diff.mean()), float(diff.max()))
    assert diff.max() > 0


def test_the_kv_dtype_roots_the_prefix_hashes(model):
    """Blocks written at one KV dtype never answer a lookup made at another (a shared tier)."""
    ids = prompts(8, [33])[0]
    cached = []
    for kv_dtype in ("auto", "int8", "fp8"):
        llm = LLM(model, dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=256,
                  kv_cache_dtype=kv_dtype)
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))
        cached.append(set(llm.scheduler.kv.cached))
    assert all(len(c) == 4 for c in cached)                      # 4 full blocks of the prompt
    assert not (cached[0] & cached[1]) and not (cached[1] & cached[2])
