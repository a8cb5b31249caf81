"""Prefix wait (scheduler/prefix_wait.py): a waiting request whose next blocks a running one is
computing waits for them and maps them, with exact block ids; it goes ahead alone when that
one is aborted, and never holds up requests that share nothing. Every test ends with the pool
whole."""
from __future__ import annotations

import pytest

from pagewire import LLM, SamplingParams
from pagewire.wire.to_scheduler import NewRequest
from tests.actors.sched_helpers import make_scheduler, new, schedulers, step
from tests.helpers import HFOracle, assert_greedy_equal

SHARED = list(range(100, 112))          # 3 blocks of 4 tokens


def shared(rid: str, tail: list[int], **sampling) -> NewRequest:
    """A request whose prompt is the 3-block SHARED prefix, then `tail`."""
    sampling.setdefault("max_tokens", 2)
    return NewRequest(req_id=rid, prompt_token_ids=SHARED + tail,
                      sampling=new("x", 1, **sampling).sampling, arrival_time=0.0)


def _run_out(sched) -> None:
    while sched.has_work():
        step(sched)


@pytest.fixture
def sched_factory():
    with schedulers(_run_out) as make:
        yield make


def test_second_request_waits_and_maps_the_first_ones_prefix(sched_factory):
    sched = sched_factory(num_blocks=16, block_size=4)
    sched.add(shared("a", [1, 2]))
    sched.add(shared("b", [3, 4]))
    plan, _ = step(sched)
    (a,) = plan.new                         # b is held: a computes blocks 0-2
    assert (a.seq_id.req, a.num_scheduled, a.block_ids) == ("a", 14, [0, 1, 2, 3])
    assert [s.seq_id.req for s in sched.waiting] == ["b"]   # counted as waiting
    plan, _ = step(sched)
    (b,) = plan.new
    assert (b.num_computed, b.num_scheduled, b.block_ids) == (12, 2, [0, 1, 2, 4])
    assert (sched.tables.prefix_hits, sched.prefix_wait.num_held) == (12, 1)


def test_a_request_computing_every_position_is_never_held(sched_factory):
    """Prompt logprobs map no prefix (Sequence.computes_every_position, as per-token pooling):
    waiting would only delay it."""
    sched = sched_factory(num_blocks=16, block_size=4)
    sched.add(shared("a", [1, 2]))
    sched.add(shared("b", [3, 4], prompt_logprobs=1))
    plan, _ = step(sched)
    assert [(s.num_scheduled, s.block_ids) for s in plan.new] == [
        (14, [0, 1, 2, 3]), (14, [4, 5, 6, 7])]
    assert sched.prefix_wait.num_held == 0


def test_off_each_computes_its_own_copy(sched_factory):
    sched = sched_factory(num_blocks=16, block_size=4, prefix_wait=False)
    sched.add(shared("a", [1, 2]))
    sched.add(shared("b", [3, 4]))
    plan, _ = step(sched)
    assert [(s.num_scheduled, s.block_ids) for s in plan.new] == [
        (14, [0, 1, 2, 3]), (14, [4, 5, 6, 7])]


def test_chunked_prefill_admits_it_once_the_shared_blocks_are_committed(sched_factory):
    sched = sched_factory(num_blocks=16, block_size=4, budget=8)
    sched.add(shared("a", list(range(1, 11))))          # 22 tokens: 3 steps of <= 8
    sched.add(shared("b", [50, 51]))
    for done in (8, 16):                                # b waits while a computes 0-3
        plan, _ = step(sched)
        assert [(s.seq_id.req, s.num_scheduled) for s in plan.new + plan.running] == [("a", 8)]
        assert sched.running[0].num_computed == done
    plan, _ = step(sched)                   # a's last chunk and b's own tail run together
    (b,) = plan.new
    assert (b.num_computed, b.num_scheduled, b.block_ids) == (12, 2, [0, 1, 2, 6])
    assert [(r.seq_id.req, r.num_scheduled) for r in plan.running] == [("a", 6)]


def test_pipelined_steps_count_blocks_only_when_applied(sched_factory):
    sched = sched_factory(num_blocks=16, block_size=4, depth=2)
    sched.add(shared("a", [1, 2]))
    sched.add(shared("b", [3, 4]))
    first = sched.schedule()
    second = sched.schedule()               # planned before a's blocks are committed
    assert [s.seq_id.req for s in first.new] == ["a"]
    assert ([r.seq_id.req for r in second.running], second.new) == (["a"], [])
    sched.update(first, sched.run())
    third = sched.schedule()
    (b,) = third.new
    assert (b.num_computed, b.block_ids[:3]) == (12, [0, 1, 2])
    sched.update(second, sched.run())
    sched.update(third, sched.run())


def test_first_aborted_mid_prefill_the_second_computes_the_prefix(sched_factory):
    sched = sched_factory(num_blocks=16, block_size=4)
    sched.add(shared("a", [1, 2]))
    sched.add(shared("b", [3, 4]))
    plan = sched.schedule()                 # a's prefill in flight, b held
    sched.abort(["a"])
    sched.update(plan, sched.run())         # a's result is dropped: nothing committed
    plan, _ = step(sched)
    (b,) = plan.new
    assert (b.num_computed, b.num_scheduled, b.block_ids) == (0, 14, [0, 1, 2, 3])   # a's, reused
    assert sched.tables.prefix_hits == 0


def test_a_request_sharing_nothing_goes_ahead_of_a_held_one(sched_factory):
    sched = sched_factory(num_blocks=16, block_size=4)
    sched.add(shared("a", [1, 2]))
    sched.add(shared("b", [3, 4]))
    sched.add(new("c", 6, max_tokens=2))
    plan, _ = step(sched)
    assert [(s.seq_id.req, s.num_scheduled) for s in plan.new] == [("a", 14), ("c", 6)]
    assert [s.seq_id.req for s in sched.waiting] == ["b"]


def test_greedy_outputs_equal_transformers_with_and_without(tiny_llama):
    """Four prompts under one 5-block prefix, in one burst, its prefill chunked."""
    path = tiny_llama("gqa2-d64")
    prefix = [(7 * i) % 500 + 3 for i in range(40)]
    prompts = [prefix + [11 + j, 200 + j, 31 * j % 400 + 3] for j in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs, hits = {}, {}
    for wait in (True, False):
        llm = LLM(path, dtype="float32", block_size=8, max_num_batched_tokens=24,
                  num_kv_blocks=128, prefix_wait=wait)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outs[wait] = [o.outputs[0].token_ids for o in got]
        hits[wait] = llm.scheduler.tables.prefix_hits
    assert outs[True] == outs[False]
    oracle = HFOracle.from_dir(path)
    for prompt, ours in zip(prompts, outs[True]):
        theirs, logits = oracle.greedy(prompt, 6)
        assert_greedy_equal(ours, theirs, logits, f"prompt ending {prompt[-3:]}")
    assert hits[True] == 3 * 40 > hits[False]      # 5 blocks of 8, three times


def test_a_computer_making_no_progress_releases_the_held_request():
    """Results for the computing sequence stop coming (plans made straight on the core, never
    answered): after STALL_PASSES passes without progress the held request goes ahead."""
    from pagewire.scheduler.prefix_wait import STALL_PASSES
    core = make_scheduler(num_blocks=16, block_size=4).core.sched
    core.add(shared("a", [1, 2], max_tokens=100))
    core.add(shared("b", [3, 4]))
    passes = 0
    while True:
        passes += 1
        planned = core.schedule(steps_in_flight=1)
        new_ids = [s.seq_id.req for s in planned[0].new] if planned else []
        if "b" in new_ids:
            break
        assert passes <= STALL_PASSES + 1, "b held past the bound"
    assert passes == STALL_PASSES + 2
    b = core.seqs[planned[0].new[-1].seq_id]
    assert (b.num_computed, b.num_scheduled) == (0, 14)
