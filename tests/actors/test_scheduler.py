"""The scheduler's plans, block tables and stop rules, step by step, with exact block ids.
After every test the KV pool is whole: all blocks free, every refcount zero."""
from __future__ import annotations

import pytest

from pagewire.wire.to_scheduler import StepResult
from tests.actors.sched_helpers import (EOS, assert_pool_whole, ids, make_scheduler, names, new,
                                        step)


@pytest.fixture(autouse=True)
def _pool_whole_after(request):
    yield
    sched = getattr(request.node, "sched", None)
    if sched is not None:
        assert_pool_whole(sched)


def test_blocks_grow_as_tokens_are_appended(request):
    sched = request.node.sched = make_scheduler()
    sched.add(new("a", 6, max_tokens=4))
    plan, deltas = step(sched)
    assert [(str(s.seq_id), s.num_scheduled, s.block_ids, s.num_computed) for s in plan.new] == \
        [("a", 6, [0, 1], 0)]
    assert [(str(d.seq_id), d.token_ids, d.finish_reason) for d in deltas] == [("a", [5], None)]
    plan, _ = step(sched)                      # 7 tokens: still 2 blocks
    assert [(str(r.seq_id), r.num_scheduled, r.block_offset, r.block_ids) for r in plan.running] == \
        [("a", 1, 2, [])]
    plan, _ = step(sched)                      # token 8 written at position 7: block 1 is full
    assert plan.running[0].block_ids == []
    plan, deltas = step(sched)                 # position 8 needs a third block
    assert (plan.running[0].block_offset, plan.running[0].block_ids) == (2, [2])
    assert deltas[0].finish_reason == "length"
    assert not sched.has_work()


def test_long_prompt_is_chunked_and_decodes_go_first(request):
    sched = request.node.sched = make_scheduler(budget=8)
    sched.add(new("a", 3, max_tokens=10))
    step(sched)                                # a: prefill 3, samples
    sched.add(new("b", 20, max_tokens=2))
    plan, deltas = step(sched)
    assert [(str(r.seq_id), r.num_scheduled) for r in plan.running] == [("a", 1)]
    assert [(str(s.seq_id), s.num_scheduled) for s in plan.new] == [("b", 7)]
    assert [str(d.seq_id) for d in deltas] == ["a"]  # b's chunk did not reach its end: no sample
    plan, deltas = step(sched)
    assert [(str(r.seq_id), r.num_scheduled) for r in plan.running] == [("a", 1), ("b", 7)]
    plan, deltas = step(sched)
    assert [(str(r.seq_id), r.num_scheduled) for r in plan.running] == [("a", 1), ("b", 6)]
    assert sorted(str(d.seq_id) for d in deltas) == ["a", "b"]
    for rid in ("a", "b"):
        sched.abort([rid])


def test_no_chunking_waits_for_a_whole_prompt_budget(request):
    sched = request.node.sched = make_scheduler(budget=64, max_len=64, chunked=False)
    sched.add(new("a", 40, max_tokens=1))
    sched.add(new("b", 40, max_tokens=1))
    plan, _ = step(sched)
    assert [(str(s.seq_id), s.num_scheduled) for s in plan.new] == [("a", 40)]
    plan, _ = step(sched)
    assert [(str(s.seq_id), s.num_scheduled) for s in plan.new] == [("b", 40)]


def test_out_of_blocks_preempts_the_latest_arrival(request):
    sched = request.node.sched = make_scheduler(num_blocks=4, block_size=4, max_len=16)
    sched.add(new("a", 7, max_tokens=20))
    sched.add(new("b", 7, max_tokens=20))
    plan, _ = step(sched)
    assert [(str(s.seq_id), s.block_ids) for s in plan.new] == [("a", [0, 1]), ("b", [2, 3])]
    plan, _ = step(sched, default=6)           # both reach 8 tokens, filling their blocks
    plan = sched.schedule()                    # a needs a 3rd block: b is preempted
    assert names(plan.preempted) == ["b"] and names(plan.finished) == []
    assert [(str(r.seq_id), r.block_ids) for r in plan.running] == [("a", [3])]  # b's last block
    assert sched.num_preemptions == 1
    assert str(sched.waiting[0].seq_id) == "b" and sched.waiting[0].num_computed == 0
    sched.update(plan, StepResult(plan.step_id, ids("a"), [7]))
    sched.abort(["a"])
    plan = sched.schedule()    # b comes back: prompt + its 2 outputs, its first block still cached
    assert names(plan.finished) == ["a"] and names(plan.preempted) == []
    (seq,) = plan.new
    assert (str(seq.seq_id), seq.token_ids[7:], seq.num_computed, seq.num_scheduled) == ("b", [5, 6], 4, 5)
    assert seq.block_ids[0] == 2
    sched.abort(["b"])


def test_abort_frees_blocks_and_tells_the_executor(request):
    sched = request.node.sched = make_scheduler()
    sched.add(new("a", 5))
    step(sched)
    deltas = sched.abort(["a", "never-seen"])
    assert [(str(d.seq_id), d.finish_reason) for d in deltas] == [("a", "abort"), ("never-seen", "abort")]
    assert sched.kv.num_free == 16
    sched.add(new("b", 3, max_tokens=1))
    plan, _ = step(sched)
    assert names(plan.finished) == ["a"]
    # A request aborted before it arrived is refused when it does.
    assert [(str(d.seq_id), d.finish_reason) for d in sched.add(new("never-seen", 3))] == \
        [("never-seen", "abort")]
    assert not sched.has_work()


def test_abort_while_step_in_flight_ignores_its_result(request):
    sched = request.node.sched = make_scheduler()
    sched.add(new("a", 5))
    sched.add(new("b", 5))
    plan = sched.schedule()
    sched.abort(["a"])
    deltas = sched.update(plan, StepResult(plan.step_id, ids("a", "b"), [9, 9]))
    assert [str(d.seq_id) for d in deltas] == ["b"]
    sched.abort(["b"])


@pytest.mark.parametrize("sampling, tokens, reason, n_out", [
    ({}, [5, EOS], "stop", 2),
    ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 5], "length", 3),
    ({"stop_token_ids": [7]}, [5, 7], "stop", 2),
    ({"max_tokens": 3}, [5, 5, 5], "length", 3),
    ({"min_tokens": 2, "stop_token_ids": [7]}, [7, 7, 7], "stop", 3),
])
def test_stop_rules(request, sampling, tokens, reason, n_out):
    sched = request.node.sched = make_scheduler()
    sched.add(new("a", 4, **sampling))
    finish = None
    for i, tok in enumerate(tokens):
        _, deltas = step(sched, {"a": tok})
        finish = deltas[0].finish_reason
        if finish:
            break
    assert (finish, i + 1) == (reason, n_out)


def test_context_full_finishes_with_length(request):
    sched = request.node.sched = make_scheduler(max_len=10)
    sched.add(new("a", 8, max_tokens=None))
    _, deltas = step(sched)
    assert deltas[0].finish_reason is None
    _, deltas = step(sched)
    assert deltas[0].finish_reason == "length"


def test_max_num_seqs_caps_the_running_set(request):
    sched = request.node.sched = make_scheduler(max_seqs=2)
    for rid in "abc":
        sched.add(new(rid, 2, max_tokens=2))
    plan, _ = step(sched)
    assert [str(s.seq_id) for s in plan.new] == ["a", "b"]
    plan, _ = step(sched)                      # a and b finish here
    plan, _ = step(sched)
    assert [str(s.seq_id) for s in plan.new] == ["c"]
    step(sched)


def test_failed_step_fails_its_requests(request):
    sched = request.node.sched = make_scheduler()
    sched.add(new("a", 5))
    plan = sched.schedule()
    deltas = sched.update(plan, StepResult(plan.step_id, [], [], error="boom"))
    assert [(str(d.seq_id), d.finish_reason, d.error) for d in deltas] == [("a", "error", "boom")]
    assert names(sched.to_drop) == ["a"] and not sched.has_work()   # the executor drops it next plan


def test_prompt_over_context_is_refused(request):
    sched = request.node.sched = make_scheduler(max_len=16)
    (delta,) = sched.add(new("a", 16))
    assert delta.finish_reason == "error" and "max_model_len" in delta.error
