"""Cascade attention in the engine: requests under one long shared prompt decode the same
greedy tokens with cascade attention on and off, and with it on their decode steps attend the
shared blocks once (kernels/cascade.py)."""
from __future__ import annotations

import random

import pytest

from pagewire import LLM, SamplingParams
from pagewire.kernels import attention, cascade


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_greedy_tokens_are_the_same_with_cascade_on_and_off(tiny_llama, monkeypatch, kernels):
    path = tiny_llama()
    rng = random.Random(4)
    system = [rng.randrange(3, 512) for _ in range(300)]     # 18 whole blocks of 16, shared
    prompts = [{"prompt_token_ids": system + [rng.randrange(3, 512) for _ in range(n)]}
               for n in (1, 3, 5, 8, 13, 16, 17, 30, 2, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    calls = []
    real = cascade.cascade_decode

    def spy(q, num_kv_heads, prefix, decode):
        calls.append((q.shape[0], prefix.blocks.tolist()))
        return real(q, num_kv_heads, prefix, decode)
    monkeypatch.setattr(attention, "cascade_decode", spy)

    def run(disable: bool):
        llm = LLM(path, dtype="float32", num_kv_blocks=256, max_model_len=512, kernels=kernels,
                  disable_cascade_attn=disable, device="cpu")
        llm.runner.model.ops.cascade_thresholds = (8, 256)      # CPU's are above this batch
        # The system prompt cached first, as an earlier request would leave it: prompts
        # prefilled in one step do not share blocks yet.
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    off = run(True)
    assert calls == []
    on = run(False)
    assert on == off
    # 10 rows a step, 2 layers, the first 18 blocks of the pool (the warm-up's prefill)
    # each time: 9 decode steps after the one that prefills.
    assert calls == [(10, list(range(18)))] * (2 * 9)
