"""Sliding-window models (every layer slides): the blocks a request's next token can no longer
see are freed as it goes, with exact block ids; forks, preemption and the engine's output
(against transformers, in a pool far too small to hold the requests whole) stay right."""
from __future__ import annotations

import random

from pagewire import LLM, SamplingParams
from tests.actors.sched_helpers import assert_pool_whole, make_scheduler, new, sid, step
from tests.actors.test_architectures import make_model
from tests.helpers import HFOracle, assert_greedy_equal


def test_blocks_behind_the_window_are_freed_in_order():
    sched = make_scheduler(num_blocks=8, block_size=4, window=8, chunked=False, max_len=32)
    sched.add(new("a", 10, max_tokens=12))
    step(sched)                                   # 10 computed: all of blocks 0-2 visible
    req = sched.seqs[sid("a")]
    assert (req.block_ids, req.num_dropped, sched.kv.num_free) == ([0, 1, 2], 0, 5)
    step(sched)                                   # 11 computed
    step(sched)                                   # 12: the next token sees 5..12: block 0 out
    assert (req.num_dropped, sched.kv.refcount[0], sched.kv.num_free) == (1, 0, 6)
    plan, _ = step(sched)                         # position 12 needs block index 3: block 3
    assert (plan.running[0].block_offset, plan.running[0].block_ids) == (3, [3])
    for _ in range(4):
        step(sched)                               # 17 computed: blocks 0 and 1 out
    assert req.block_ids[:4] == [0, 1, 2, 3] and req.num_dropped == 2
    assert sched.kv.num_free == 8 - 3             # 2, 3 and the block of position 16
    while sched.has_work():
        step(sched)
    assert_pool_whole(sched)


def test_forks_and_preemption_with_dropped_blocks_leave_the_pool_whole():
    sched = make_scheduler(num_blocks=10, block_size=4, window=8, swap_space=4096, max_len=40,
                           preemption_mode="swap")
    sched.add(new("a", 14, max_tokens=20, n=2, temperature=1.0, seed=1))
    sched.add(new("b", 9, max_tokens=25))
    sched.add(new("c", 11, max_tokens=25))
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
        assert steps < 500
    assert sched.num_preemptions > 0              # by recompute: swap refuses dropped tables
    assert_pool_whole(sched)


def test_engine_matches_transformers_in_a_pool_smaller_than_its_requests(tmp_path,
                                                                         smol_tokenizer_dir):
    path = make_model(str(tmp_path / "mistral"), smol_tokenizer_dir, "mistral-window")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(4)]
    # 28 blocks of 4 = 112 slots for 4 requests of 64 tokens: they fit only because each
    # holds no more than its window (16 tokens) plus a few blocks.
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=28, max_num_batched_tokens=24,
              max_model_len=96)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.scheduler.num_preemptions == 0     # the window kept them all resident
    oracle = HFOracle.from_dir(path)
    for prompt, out in zip(prompts, outputs):
        theirs, logits = oracle.greedy(prompt, 24)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, "windowed")
