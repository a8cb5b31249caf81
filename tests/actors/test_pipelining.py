"""Pipelined steps: the scheduler plans step N+1 while step N runs (two plans in flight), and
the executor's sequence table feeds N's sampled tokens into N+1. Outcomes must equal one plan
in flight, with no block leaked."""
from __future__ import annotations

import pytest

from pagewire.wire.to_scheduler import StepResult

from .sched_helpers import EOS, assert_pool_whole, make_scheduler, names, new, sid


def test_a_decode_is_planned_before_the_previous_token_is_known():
    sched = make_scheduler(num_blocks=8, block_size=4, max_len=32, depth=2)
    sched.add(new("a", 4, max_tokens=3))
    first = sched.schedule()                  # the prompt: samples output 1
    second = sched.schedule()                 # output 1's row, planned before output 1 exists
    assert [s.num_scheduled for s in first.new] == [4] and first.new[0].block_ids == [0]
    assert [(str(r.seq_id), r.num_scheduled, r.block_offset, r.block_ids) for r in second.running] \
        == [("a", 1, 1, [1])]                 # position 4 opens block 1
    assert sched.schedule() is None           # two in flight: no third plan
    results = [sched.run(default=7), sched.run(default=8)]
    seq = sched.executor.seqs[sid("a")]
    assert seq.token_ids[4:] == [7, 8] and seq.num_computed == 5   # step 2 read 7 itself
    deltas = [d for p, r in zip((first, second), results) for d in sched.update(p, r)]
    assert [(d.token_ids, d.finish_reason) for d in deltas] == [([7], None), ([8], None)]
    third = sched.schedule()
    assert [(r.num_scheduled, r.block_ids) for r in third.running] == [(1, [])]


def test_nothing_is_planned_past_a_max_tokens_end():
    sched = make_scheduler(depth=2)
    sched.add(new("a", 4, max_tokens=2))
    plans = [sched.schedule(), sched.schedule()]
    assert sched.schedule() is None
    deltas = [d for p in plans for d in sched.update(p, sched.run(default=5))]
    assert [(d.token_ids, d.finish_reason) for d in deltas] == [([5], None), ([5], "length")]
    sched.add(new("b", 4, max_tokens=1))
    only = sched.schedule()
    assert sched.schedule() is None and sched.engine.stalled   # its one token is in flight
    assert [d.finish_reason for d in sched.update(only, sched.run())] == ["length"]
    assert sched.schedule() is None and not sched.has_work()
    assert_pool_whole(sched)


def test_a_stop_token_ends_the_sequence_and_its_planned_ahead_row_is_skipped():
    sched = make_scheduler(depth=2)
    sched.add(new("a", 4))
    sched.add(new("b", 4))
    first, second = sched.schedule(), sched.schedule()
    assert {str(r.seq_id) for r in second.running} == {"a", "b"}
    r1 = sched.run(tokens={"a": EOS})
    r2 = sched.run(default=6)
    assert names(r2.seq_ids) == ["b"]                # the executor knew a had stopped
    assert [(str(d.seq_id), d.finish_reason) for d in sched.update(first, r1)] == \
        [("a", "stop"), ("b", None)]
    assert [str(d.seq_id) for d in sched.update(second, r2)] == ["b"]
    third = sched.schedule()
    assert names(third.finished) == ["a"] and [str(r.seq_id) for r in third.running] == ["b"]
    sched.abort(["b"])
    sched.update(third, sched.run())
    sched.schedule()
    assert_pool_whole(sched)


def test_an_abort_with_two_steps_in_flight_frees_everything_and_ignores_both_results():
    sched = make_scheduler(depth=2)
    sched.add(new("a", 6))
    first, second = sched.schedule(), sched.schedule()
    assert [d.finish_reason for d in sched.abort(["a"])] == ["abort"]
    assert sched.kv.num_free == sched.kv.num_blocks         # freed at once
    assert sched.update(first, sched.run()) == [] and sched.update(second, sched.run()) == []
    assert not sched.has_work() and sched.engine.num_in_flight == 0
    assert_pool_whole(sched)


def test_a_failed_step_fails_its_requests_and_the_step_planned_behind_it_skips_them():
    sched = make_scheduler(depth=2)
    sched.add(new("a", 4))
    first = sched.schedule()
    sched.add(new("b", 4))
    second = sched.schedule()                 # a's next token, and b's prompt
    failed = sched.update(first, StepResult(first.step_id, [], [], error="boom"))
    assert [(str(d.seq_id), d.finish_reason, d.error) for d in failed] == [("a", "error", "boom")]
    result = sched.run()
    assert names(result.seq_ids) == ["b"]            # a's row was left out: its state was dropped
    assert [str(d.seq_id) for d in sched.update(second, result)] == ["b"]
    third = sched.schedule()
    assert names(third.finished) == ["a"]
    sched.abort(["b"])
    sched.update(third, sched.run())
    assert "a" not in sched.executor.failed | set(sched.executor.seqs)   # the plan dropped it
    sched.schedule()
    assert_pool_whole(sched)


def deterministic(seq) -> int:
    """A stand-in model: the next token is a function of the tokens so far (EOS now and then)."""
    h = sum((i + 1) * t for i, t in enumerate(seq.token_ids[-3:])) % 23
    return EOS if h == 0 else 10 + h


def run_to_end(sched, requests) -> tuple[dict, int]:
    """Run every request to its end, planning as far ahead as the core allows; per output id,
    its tokens and finish reason, and how many plans were made with another in flight."""
    out: dict[str, list] = {}
    ahead = 0
    for r in requests:
        sched.add(r)
    while sched.engine.busy():
        while sched.schedule() is not None:
            ahead += sched.engine.num_in_flight > 1
        plan = sched.not_run[0]
        for d in sched.update(plan, sched.run(model=deterministic)):
            tokens, _ = out.setdefault(str(d.seq_id), [[], None])
            out[str(d.seq_id)] = [tokens + d.token_ids, d.finish_reason]
    sched.schedule()                      # the last plan's drops
    return out, ahead


@pytest.mark.parametrize("pool, options", [
    (64, {}),
    (12, {}),                                       # preemption by recompute
    (12, {"swap_space": 16 * 256, "preemption_mode": "swap", "dtype": "float32"}),  # 16 blocks
])
def test_outputs_equal_one_plan_in_flight(pool, options):
    """n > 1, best_of, beams, stop ids, min/max tokens and chunked prompts, in a pool small
    enough to preempt: the same outputs with two plans in flight as with one."""
    def requests():
        return [new("a", 9, max_tokens=12), new("b", 3, n=2, max_tokens=6),
                new("c", 5, best_of=3, n=1, max_tokens=5, logprobs=0),
                new("d", 4, use_beam_search=True, n=2, max_tokens=4),
                new("e", 13, stop_token_ids=[13], min_tokens=2, max_tokens=20),
                new("f", 2, ignore_eos=True, max_tokens=15)]
    outputs, ahead = [], []
    for depth in (1, 2):
        sched = make_scheduler(num_blocks=pool, block_size=4, budget=8, max_len=40, depth=depth,
                               **options)
        out, planned_ahead = run_to_end(sched, requests())
        outputs.append(out)
        ahead.append(planned_ahead)
        assert_pool_whole(sched)
        preempted = sched.num_preemptions
    assert outputs[0] == outputs[1]
    assert ahead[0] == 0 and ahead[1] > 10
    assert len(outputs[0]) == 1 + 2 + 3 + 2 + 1 + 1
    assert (preempted > 0) == (pool < 64)


def test_offline_engine_pipelines_and_a_step_left_with_only_stopped_rows_runs_empty(
        tiny_llama):
    """Through the offline LLM (the executor on its own thread): a sequence that stops on its
    first token leaves the step planned behind it with no row at all; greedy outputs equal
    those with one plan in flight, and every block comes back."""
    from pagewire import LLM, SamplingParams
    model = tiny_llama()
    stop_first = SamplingParams(max_tokens=8, allowed_token_ids=[7], stop_token_ids=[7])
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for pipelined in (True, False):
        llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
                  async_scheduling=pipelined)
        (alone,) = llm.generate([[5, 6, 9]], stop_first)
        assert (alone.outputs[0].token_ids, alone.outputs[0].finish_reason) == ([7], "stop")
        outs = llm.generate([[5, 6, 9], [11, 12, 13, 14, 15], [8] * 9], greedy)
        outputs.append([o.outputs[0].token_ids for o in outs])
        assert llm.engine.num_in_flight == 0 and llm.scheduler.kv.num_free == 64
    assert outputs[0] == outputs[1] and all(len(t) == 12 for t in outputs[0])


def test_step_durations_count_a_queued_step_from_the_result_before_it():
    from pagewire.scheduler.actor import StatsReporter
    sched = make_scheduler(depth=2)
    now = [100.0]
    rep = StatsReporter(sched, lambda stats: None, clock=lambda: now[0])
    sched.add(new("a", 4))
    rep.on_plan(sched.schedule())
    now[0] = 100.1
    rep.on_plan(sched.schedule())             # queued behind the first
    now[0] = 100.4
    assert rep.step_running_for() == pytest.approx(0.4)
    rep.on_result()                           # the first: 0.4 s since it was sent
    now[0] = 100.6
    assert rep.step_running_for() == pytest.approx(0.2)   # the second began at 100.4
    rep.on_result()
    assert rep.step_durations == pytest.approx([0.4, 0.2])
    assert rep.step_running_for() == 0.0


@pytest.mark.parametrize("device, asked, resolved", [
    ("cpu", None, False), ("cuda", None, True), ("cpu", True, True), ("cuda", False, False)])
def test_async_scheduling_is_on_by_default_only_on_a_gpu(device, asked, resolved):
    sched = make_scheduler(device=device, async_scheduling=asked, depth=None)
    assert sched.config.scheduler.async_scheduling is resolved
    assert sched.engine.depth == (2 if resolved else 1)
