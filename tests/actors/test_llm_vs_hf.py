"""Greedy tokens from our engine equal transformers' on the same tiny random-weight models,
whatever the batch around them: mixed lengths, chunked prefills, requests joining mid-flight."""
from __future__ import annotations

import random

import pytest

from pagewire import LLM, SamplingParams
from tests.helpers import HFOracle, TINY_SHAPES, assert_greedy_equal


def _prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_batched_greedy_matches_transformers(tiny_llama, shape, block_size):
    path = tiny_llama(shape)
    lengths = [1, 7, 16, 33, 70]
    prompts = _prompts(block_size, lengths)
    # A small token budget splits the long prompts into chunks that share steps with decodes.
    llm = LLM(path, dtype="float32", block_size=block_size, max_num_batched_tokens=24,
              num_kv_blocks=4096 // block_size)
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = HFOracle.from_dir(path)
    for prompt, param, out in zip(prompts, params, outputs):
        theirs, logits = oracle.greedy(prompt, param.max_tokens)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"prompt of {len(prompt)}")
        assert out.outputs[0].finish_reason == "length"
    _assert_pool_whole(llm)


def test_requests_join_mid_flight(tiny_llama):
    path = tiny_llama("gqa2-d64")
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=32, max_num_seqs=3,
              num_kv_blocks=256)
    prompts = _prompts(7, [5, 40, 12, 90, 3, 21])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts[:3]]
    done = {}
    for _ in range(4):
        done.update((o.request_id, o) for o in llm.step())
    ids += [llm.add_request(p, params) for p in prompts[3:]]   # join while others decode
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    oracle = HFOracle.from_dir(path)
    for rid, prompt in zip(ids, prompts):
        theirs, logits = oracle.greedy(prompt, 10)
        assert_greedy_equal(done[rid].outputs[0].token_ids, theirs, logits, f"request {rid}")
    _assert_pool_whole(llm)


def test_preempted_request_resumes_with_the_same_tokens(tiny_llama):
    """A KV pool too small for all requests forces recompute preemption mid-decode."""
    path = tiny_llama("gqa2-d64")
    prompts = _prompts(3, [30, 31, 29, 30])
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    alone = LLM(path, dtype="float32", block_size=4, num_kv_blocks=256)
    expected = [alone.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids
                for p, sp in zip(prompts, [greedy, seeded] * 2)]
    tight = LLM(path, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=128)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], [greedy, seeded] * 2)
    assert tight.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_pool_whole(tight)


def _assert_pool_whole(llm: LLM) -> None:
    kv = llm.scheduler.kv
    assert kv.num_free == kv.num_blocks
    assert sorted(kv.free_queue) == list(range(kv.num_blocks))
    assert not any(kv.refcount)
    assert not llm.scheduler.requests
