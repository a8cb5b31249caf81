"""Overlapped steps (executor/step_overlap.py): step N+1 launched before step N's tokens are
read back, its rows taking them on the device. Outcomes must equal those of one step at a
time, with every block back."""
from __future__ import annotations

import pytest

from pagewire.executor.seq_table import PENDING, SeqTable
from pagewire.executor.step_overlap import Launched, StepOverlap
from pagewire.wire.ids import SeqId
from pagewire.wire.sampling_params import SamplingParams
from pagewire.wire.to_executor import NewSeq, RunSeq, StepPlan
from pagewire.wire.to_scheduler import SampledLogprobs, StepResult

EOS = 2


def _run(model: str, overlap: bool, batches):
    """Each (prompts, params) batch through one LLM; (tokens and finish reasons per batch, how
    many steps were launched ahead of an unfinished one)."""
    from pagewire import LLM
    llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=64,
              async_scheduling=overlap)
    assert llm.runner.overlap == overlap
    launch, ahead = llm.runner.launch, []

    def counted(plan, after=None, plain=None):
        ahead.append(after is not None)
        return launch(plan, after, plain)
    llm.runner.launch = counted
    outs = []
    for prompts, params in batches:
        done = llm.generate(prompts, params)
        outs.append([[(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in o.outputs]
                     for o in done])
    assert llm.engine.num_in_flight == 0 and llm.scheduler.kv.num_free == 96
    return outs, sum(ahead)


def test_overlapped_steps_give_the_outputs_of_one_step_at_a_time(tiny_llama):
    model = tiny_llama()
    prompts = [[5, 6, 9], [11, 12, 13, 14, 15], [8] * 9, [20, 21]]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (plain,), _ = _run(model, False, [(prompts, greedy)])
    # stop on a token each greedy output reaches at its 2nd-4th place (a stopped row's
    # overlapped twin is dropped), with min_tokens holding one of them back
    stops = [SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[c[0][0][1 + i % 3]],
                            min_tokens=3 if i == 1 else 0, logprobs=1)
             for i, c in enumerate(plain)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=7, n=2)
    batches = [(prompts, greedy), (prompts, stops), (prompts[:2], seeded)]
    one_at_a_time, none_ahead = _run(model, False, batches)
    overlapped, launched_ahead = _run(model, True, batches)
    assert none_ahead == 0 and launched_ahead >= 10
    assert overlapped == one_at_a_time
    assert [c[0][1] for c in one_at_a_time[1]] == ["stop"] * 4


def test_a_grammar_step_is_finished_before_the_next_starts(tiny_llama):
    """A constrained sequence is not plain: with it in the batch no step is launched ahead,
    and its output is what it is one step at a time."""
    from pagewire.wire.structured import StructuredOutputsParams
    model = tiny_llama()
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    batches = [([[5, 6, 9], [11, 12, 13]], params)]
    (one,), _ = _run(model, False, batches)
    (overlapped,), _ = _run(model, True, batches)
    assert overlapped == one


def _seq(name: str) -> SeqId:
    return SeqId(name, 0)


def test_a_reserved_token_is_settled_in_place_and_a_stopped_sequence_drops_its_next():
    table = SeqTable([EOS])
    params = SamplingParams(max_tokens=8)
    plan = StepPlan(1, [NewSeq(_seq("a"), [5, 6], 2, 0, 2, [0], params),
                        NewSeq(_seq("b"), [7], 1, 0, 1, [1], params)], [], [])
    order = table.apply(plan)
    a, b = table.seqs[_seq("a")], table.seqs[_seq("b")]
    both = [(_seq("a"), a), (_seq("b"), b)]
    first = table.reserve(order, both)
    assert a.token_ids == [5, 6, PENDING] and b.token_ids == [7, PENDING]
    assert first == [(2, 1), (1, 1)] and (a.num_computed, b.num_computed) == (2, 1)
    # the next plan runs both rows before the first step's tokens are known
    second_plan = StepPlan(2, [], [RunSeq(_seq("a"), 1, 1, []), RunSeq(_seq("b"), 1, 1, [])],
                           [])
    order2 = table.apply(second_plan)
    second = table.reserve(order2, both)
    assert a.token_ids == [5, 6, PENDING, PENDING] and second == [(3, 2), (2, 2)]
    assert table.settle(both, first, [9, EOS]) == [0, 1]        # b stops on EOS
    assert a.token_ids[2] == 9 and b.token_ids == [7, EOS, PENDING] and b.stopped
    assert table.settle(both, second, [10, 11]) == [0]          # b's row was wasted
    assert a.token_ids == [5, 6, 9, 10] and b.token_ids == [7, EOS]
    step = Launched(second_plan, StepResult(2, [_seq("a"), _seq("b")], [10, 11],
                                            logprobs=SampledLogprobs([-1.0, -2.0], [[], []],
                                                                     [[], []])),
                    order2, both)
    step.keep([0])
    assert (step.result.seq_ids, step.result.token_ids, step.result.logprobs.logprobs) == \
        ([_seq("a")], [10], [-1.0])


class _Runner:
    """A stand-in runner: plans named "plain" reserve (are held), others finish at once;
    a plan named "boom" raises when launched."""

    class table:
        @staticmethod
        def plain_plan(plan) -> bool:
            return plan == "plain"

    def __init__(self):
        self.calls, self.failed = [], []

    def launch(self, plan, after=None, plain=None):
        self.calls.append(("launch", plan, after is not None))
        if plan == "boom":
            raise ValueError("boom")
        return Launched(plan, f"result {len(self.calls)}", [], places=[] if plan == "plain"
                        else None)

    def finish(self, step):
        self.calls.append(("finish", step.plan))
        return step.result

    def fail(self, plan):
        self.failed.append(plan)


def test_outcomes_leave_in_plan_order_and_a_failed_launch_finishes_the_held_step_first():
    runner = _Runner()
    overlap = StepOverlap(runner)
    assert overlap.run("plain", 1) == [] and overlap.held is not None
    assert overlap.run("plain", 2) == [(1, "result 1")]          # 2 launched ahead of 1
    assert overlap.run("grammar", 3) == [(2, "result 2"), (3, "result 5")]
    assert runner.calls[:6] == [("launch", "plain", False), ("launch", "plain", True),
                                ("finish", "plain"), ("finish", "plain"),
                                ("launch", "grammar", False), ("finish", "grammar")]
    overlap.run("plain", 4)
    done = overlap.run("boom", 5)
    assert done[0] == (4, "result 7") and done[1][0] == 5
    assert isinstance(done[1][1], ValueError) and overlap.held is None
    assert overlap.finish_held() == []


def test_the_overlapping_worker_lets_its_engine_go(tiny_llama):
    """The offline LLM's worker thread holds the runner (its weights and KV pool) only while
    the LLM lives."""
    import gc
    import threading
    import time
    import weakref

    from pagewire import LLM
    before = set(threading.enumerate())
    llm = LLM(tiny_llama(), dtype="float32", block_size=4, num_kv_blocks=32, max_model_len=32,
              async_scheduling=True)
    llm.generate([[5, 6, 9]], SamplingParams(temperature=0, max_tokens=3))
    runner = weakref.ref(llm.runner)
    workers = [t for t in threading.enumerate()
               if t not in before and t.name == "pagewire-executor"]
    assert len(workers) == 1
    del llm
    gc.collect()
    for worker in workers:
        worker.join(timeout=5)
    time.sleep(0.05)
    assert runner() is None and not any(t.is_alive() for t in workers)


def test_overlapped_steps_under_preemption_give_the_same_tokens(tiny_llama):
    """A pool too small for every sequence preempts (by recompute) while steps overlap: the
    tokens are those of one step at a time, and every block comes back."""
    from pagewire import LLM
    model = tiny_llama()
    prompts = [[5, 6, 9], [11, 12, 13, 14, 15], [8] * 9, [20, 21], [30] * 6, [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    outs, preempted = [], []
    for overlap in (False, True):
        llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=12, max_model_len=40,
                  max_num_seqs=6, async_scheduling=overlap)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        preempted.append(llm.scheduler.num_preemptions)
        assert llm.engine.num_in_flight == 0 and llm.scheduler.kv.num_free == 12
    assert outs[0] == outs[1] and all(len(t) == 14 for t in outs[0])
    assert min(preempted) > 0
