"""Prefix caching, copy-on-write forks, swap and priority preemption, queue limits and chunked
prefill at the scheduler, with exact block ids. Every test ends with the pool whole."""
from __future__ import annotations

import pytest

from pagewire.wire.to_scheduler import NewRequest, SampledLogprobs, StepResult
from tests.actors.sched_helpers import ids, names, new, schedulers, sid, step


def _abort_all(sched) -> None:
    for rid in list(sched.seqs) + list(sched.groups):
        sched.abort([rid])
    sched.schedule()   # drop the executor state list


@pytest.fixture
def sched_factory():
    with schedulers(_abort_all) as make:
        yield make


def run_to_end(sched, **kw):
    deltas = []
    while sched.has_work():
        deltas += step(sched, **kw)[1]
    return deltas


def test_shared_prefix_maps_cached_blocks(sched_factory):
    sched = sched_factory(num_blocks=16, block_size=4)
    sched.add(new("a", 10, first=100, max_tokens=1))
    plan, _ = step(sched)
    assert plan.new[0].block_ids == [0, 1, 2]
    # a is done; its full blocks 0 and 1 stay cached. b shares 8 prompt tokens, then differs.
    prompt = list(range(100, 108)) + [7, 7, 7]
    sched.add(NewRequest(req_id="b", prompt_token_ids=prompt, sampling=new("x", 1).sampling,
                         arrival_time=0.0))
    plan, _ = step(sched)
    (seq,) = plan.new
    assert (seq.num_computed, seq.num_scheduled, seq.block_ids) == (8, 3, [0, 1, 2])  # a's unhashed 2 reused
    assert (sched.tables.prefix_queries, sched.tables.prefix_hits) == (10 + 11, 8)
    run_to_end(sched)


def test_whole_prompt_hit_still_computes_its_last_token(sched_factory):
    sched = sched_factory(block_size=4)
    sched.add(new("a", 8, first=100, max_tokens=1))
    step(sched)
    sched.add(new("b", 8, first=100, max_tokens=1))
    plan, _ = step(sched)
    assert (plan.new[0].num_computed, plan.new[0].num_scheduled) == (4, 4)


def test_different_salts_never_share(sched_factory):
    sched = sched_factory(block_size=4)
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        msg = new(rid, 9, first=100, max_tokens=1)
        msg.cache_salt = salt
        sched.add(msg)
        plan, _ = step(sched)
        hit = plan.new[0].num_computed
        assert hit == (8 if rid == "c" else 0), rid


def test_prefix_caching_off_never_hits(sched_factory):
    sched = sched_factory(block_size=4, enable_prefix_caching=False)
    for rid in "ab":
        sched.add(new(rid, 9, first=100, max_tokens=1))
        plan, _ = step(sched)
        assert plan.new[0].num_computed == 0
    assert not sched.kv.cached


def test_in_use_blocks_are_never_evicted(sched_factory):
    sched = sched_factory(num_blocks=6, block_size=4, max_len=24)
    sched.add(new("a", 8, first=100, max_tokens=10))   # holds blocks 0, 1 while running
    step(sched)
    sched.add(new("b", 12, first=500, max_tokens=1))   # a's decode takes 2; b takes 3, 4, 5
    step(sched)
    assert set(sched.kv.cached.values()) == {0, 1, 3, 4, 5}
    sched.add(new("c", 9, first=900, max_tokens=1))    # needs 3: evicts b's blocks, not a's
    plan, _ = step(sched)
    assert plan.new[0].block_ids == [5, 4, 3]          # b freed its tail first
    assert set(sched.kv.cached.values()) == {0, 1, 5, 4}
    assert sched.kv.refcount[:3] == [1, 1, 1]


def test_n8_shares_the_prompt_and_copies_only_the_partial_block(sched_factory):
    sched = sched_factory(num_blocks=64, block_size=16, budget=512, max_len=256)
    sched.add(new("p", 100, first=100, n=8, temperature=1.0, max_tokens=10))
    plan, deltas = step(sched)                 # the leader computes 99 tokens, then forks
    assert [(str(s.seq_id), s.num_scheduled) for s in plan.new] == [("p#prompt", 99)]
    assert deltas == [] and sched.kv.num_blocks - sched.kv.num_free == 7
    plan, deltas = step(sched)                 # each child computes token 99 and samples
    assert names(plan.finished) == ["p#prompt"]
    assert sorted(str(s.seq_id) for s in plan.new) == names(ids(*(f"p#{j}" for j in range(8))))
    assert len(plan.copies) == 7               # the 8th writer holds the partial block alone
    assert {src for src, _ in plan.copies} == {6}
    assert {tuple(s.block_ids[:6]) for s in plan.new} == {(0, 1, 2, 3, 4, 5)}
    assert len({s.block_ids[6] for s in plan.new}) == 8
    assert sorted(str(d.seq_id) for d in deltas) == names(ids(*(f"p#{j}" for j in range(8))))
    for _ in range(8):
        step(sched)
    # One prompt (6 full blocks, shared) plus eight tails (one block each), not 8 prompts.
    assert sched.kv.num_blocks - sched.kv.num_free == 6 + 8
    assert all(sched.kv.refcount[b] == 8 for b in range(6))
    run_to_end(sched)


def test_children_get_consecutive_seeds(sched_factory):
    sched = sched_factory(block_size=4)
    sched.add(new("p", 5, n=3, temperature=1.0, seed=41, max_tokens=2))
    step(sched)
    plan, _ = step(sched)
    assert [(str(s.seq_id), s.sampling.seed, s.sampling.n) for s in plan.new] == \
        [("p", 41, 1), ("p#1", 42, 1), ("p#2", 43, 1)]
    run_to_end(sched)


def test_forks_and_beams_are_sequences_of_one_request(sched_factory):
    """n forks and beams reference their request's record (prompt, sampling, priority,
    arrival) instead of copying it; a request without a feature holds none of its records."""
    sched = sched_factory(num_blocks=32, block_size=4)
    sched.add(new("p", 5, n=2, temperature=1.0, seed=41, max_tokens=3))
    sched.add(new("q", 6, n=2, use_beam_search=True, best_of=3, max_tokens=3))
    step(sched, default=30)
    req = sched.requests["p"]
    assert [str(s.seq_id) for s in req.seqs] == ["p", "p#1"] == \
        [str(s.seq_id) for s in sched.seqs.values() if s.request is req]
    assert (req.req_id, req.num_prompt_tokens, req.sampling.n, req.max_tokens) == ("p", 5, 2, 3)
    assert [s.sampling.seed for s in req.seqs] == [41, 42]        # each fork's own sampling
    beams = sched.requests["q"]
    assert beams.group is sched.groups["q"] and len(beams.seqs) == 3
    assert sorted(names(b.seq_id for b in beams.seqs)) == \
        sorted(names(b.seq_id for b in beams.group.live)) == ["q#beam0", "q#beam1", "q#beam2"]
    for seq in sched.seqs.values():
        assert (seq.spec, seq.compress, seq.request.stream, seq.request.transfer) == \
            (None, None, None, None)
    run_to_end(sched)
    assert not sched.requests and not sched.seqs and not req.seqs


def test_beam_search_forks_and_frees_beams(sched_factory):
    sched = sched_factory(num_blocks=32, block_size=4, max_len=64)
    sched.add(new("q", 6, n=2, use_beam_search=True, best_of=3, max_tokens=3))
    plan = sched.schedule()
    (beam0,) = plan.new
    assert str(beam0.seq_id) == "q#beam0" and beam0.sampling.use_beam_search
    # top-6 candidates of the only beam: the best three survive (beam0 kept, beam1 and beam2 forked)
    result = StepResult(plan.step_id, ids("q#beam0"), [30], logprobs=SampledLogprobs(
        [0.0], [[30, 31, 32, 33, 34, 35]], [[-0.1, -0.2, -0.3, -2.0, -3.0, -4.0]]))
    assert sched.update(plan, result) == []
    assert sorted(names(r.seq_id for r in sched.groups["q"].live)) == \
        ["q#beam0", "q#beam1", "q#beam2"]
    plan = sched.schedule()
    assert [(str(r.seq_id), r.new_token_ids) for r in plan.running] == [("q#beam0", [30])]
    assert sorted((str(s.seq_id), s.token_ids[-1]) for s in plan.new) == \
        [("q#beam1", 31), ("q#beam2", 32)]
    # Both forks share beam0's partial block (positions 4-6): the two first writers copy it.
    assert len(plan.copies) == 2
    tops = {"q#beam0": [40, 41], "q#beam1": [50, 51], "q#beam2": [60, 61]}
    lps = {"q#beam0": [-5.0, -6.0], "q#beam1": [-0.1, -0.2], "q#beam2": [-0.3, -7.0]}
    seqs = [s.seq_id for s in plan.running] + [s.seq_id for s in plan.new]
    result = StepResult(plan.step_id, seqs, [0] * 3, logprobs=SampledLogprobs(
        [0.0] * 3, [tops[str(s)] + [1, 2, 3, 4] for s in seqs],
        [lps[str(s)] + [-9.0] * 4 for s in seqs]))
    sched.update(plan, result)
    # beam1 is chosen twice (fork beam3), beam2 once, beam0 not at all: freed.
    live = sorted((str(b.seq_id), b.token_ids[6:]) for b in sched.groups["q"].live)
    assert live == [("q#beam1", [31, 50]), ("q#beam2", [32, 60]), ("q#beam3", [31, 51])]
    assert sid("q#beam0") not in sched.seqs and names(sched.to_drop) == ["q#beam0"]
    run_to_end(sched)


def test_swap_preemption_moves_blocks_to_the_host_tier(sched_factory):
    sched = sched_factory(num_blocks=4, block_size=4, max_len=16, swap_space=1 << 20)
    sched.add(new("a", 7, max_tokens=9))
    sched.add(new("b", 7, max_tokens=9))
    step(sched)
    step(sched)
    plan = sched.schedule()                    # a needs a 3rd block: b is swapped out
    assert names(plan.preempted) == ["b"] and plan.swap_out == [[2, 0], [3, 1]]
    assert [(str(r.seq_id), r.block_offset, r.block_ids) for r in plan.running] == [("a", 2, [3])]
    swapped = sched.waiting[0]
    assert (str(swapped.seq_id), swapped.num_computed, swapped.host_block_ids) == ("b", 8, [0, 1])
    sched.update(plan, StepResult(plan.step_id, ids("a"), [5]))
    sched.abort(["a"])
    plan = sched.schedule()                    # b comes back with its computed tokens
    assert plan.swap_in == [[0, 3], [1, 2]]
    assert [(str(s.seq_id), s.num_computed, s.num_scheduled, s.block_ids) for s in plan.new] == \
        [("b", 8, 1, [3, 2, 1])]
    assert sched.tables.host.num_free == sched.tables.host.num_blocks
    sched.update(plan, StepResult(plan.step_id, ids("b"), [5]))


def test_priority_preempts_lower_priority_work(sched_factory):
    sched = sched_factory(num_blocks=4, block_size=4, max_len=16, scheduling_policy="priority")
    low = new("low", 12, max_tokens=4)
    low.priority = 5
    sched.add(low)
    step(sched)
    high = new("high", 7, max_tokens=1)
    high.priority = -1
    sched.add(high)
    plan, _ = step(sched)
    assert names(plan.preempted) == ["low"] and [str(s.seq_id) for s in plan.new] == ["high"]
    assert sched.num_preemptions == 1
    run_to_end(sched)


def test_fcfs_ignores_priority(sched_factory):
    sched = sched_factory(scheduling_policy="fcfs")
    a, b = new("a", 3, max_tokens=1), new("b", 3, max_tokens=1)
    a.priority, b.priority = 9, -9
    sched.add(a)
    sched.add(b)
    assert [str(r.seq_id) for r in sched.waiting] == ["a", "b"]
    run_to_end(sched)


def test_queue_limits_refuse_new_requests(sched_factory):
    sched = sched_factory(max_num_queued_reqs=2, max_num_queued_tokens=100, max_len=128,
                          num_blocks=64)
    assert sched.add(new("a", 10)) == [] and sched.add(new("b", 10)) == []
    (d,) = sched.add(new("c", 10))
    assert (str(d.seq_id), d.finish_reason) == ("c", "rejected") and "2 requests" in d.error
    sched.waiting.pop()   # leave one waiting: now the token limit binds
    sched.seqs.pop(sid("b"))
    sched.requests.pop("b")
    (d,) = sched.add(new("d", 95))
    assert d.finish_reason == "rejected" and "100 prompt tokens" in d.error
    ds = sched.add(new("e", 10, n=2))
    assert ds == []
    run_to_end(sched)


def test_decodes_keep_flowing_while_a_long_prompt_is_chunked(sched_factory):
    sched = sched_factory(num_blocks=64, block_size=4, budget=16, max_len=200)
    sched.add(new("d", 3, max_tokens=50))
    step(sched)
    sched.add(new("long", 120, max_tokens=1))
    steps = 0
    while sid("long") in sched.seqs:
        plan, _ = step(sched)
        counts = {str(r.seq_id): r.num_scheduled for r in plan.running} | \
                 {str(s.seq_id): s.num_scheduled for s in plan.new}
        assert counts["d"] == 1 and sum(counts.values()) <= 16
        steps += 1
    assert steps == 8   # 120 tokens at 15 per step
    run_to_end(sched)


def test_abort_all_ends_every_request_by_its_output_ids(sched_factory):
    sched = sched_factory(num_blocks=64, block_size=4)
    sched.add(new("a", 5, max_tokens=9))
    sched.add(new("p", 6, n=2, temperature=1.0, max_tokens=9))
    sched.add(new("q", 6, n=2, use_beam_search=True, max_tokens=9))
    step(sched)
    deltas = sched.abort_all()
    assert sorted(str(d.seq_id) for d in deltas) == ["a", "p", "p#1", "q", "q#1"]
    assert all(d.finish_reason == "abort" for d in deltas)
    assert not sched.requests and not sched.groups and not sched.has_work()


def test_a_fork_shares_no_mutable_slot_with_its_parent():
    """Every slot of a sequence is either shared as an immutable value (or the request both
    belong to), copied, or the fork's own (Sequence.SHARED / COPIED / FRESH): a slot added
    later must be placed, and no list of the fork is its parent's."""
    from pagewire.scheduler.request import Request, Sequence
    from pagewire.wire.sampling_params import SamplingParams
    slots = Sequence.SHARED + Sequence.COPIED + Sequence.FRESH
    assert sorted(slots) == sorted(Sequence.__slots__) and len(set(slots)) == len(slots)
    req = Request("p", 3, SamplingParams(n=2), 0.0, 64)
    parent = Sequence(sid("p#prompt"), req, [1, 2, 3])
    parent.block_ids, parent.block_hashes, parent.host_block_ids = [4], [b"h"], [7]
    child = parent.fork(sid("p#1"), SamplingParams(seed=1))
    for name in Sequence.__slots__:
        value = getattr(child, name)
        if isinstance(value, (list, dict, tuple)) and value:
            assert value is not getattr(parent, name), name
    assert (child.token_ids, child.block_ids, child.host_block_ids) == ([1, 2, 3], [4], [])
    assert str(child.seq_id) == "p#1" and not child.on_executor
    assert child.request is req and child.sampling.seed == 1 and parent.sampling.n == 2
