"""The step engine (scheduler/engine.py): its ledger is the one record of plans in flight, it
plans ahead as far as its depth allows and no further, and its executor handles run plans in
order. The core's rules for planning ahead are in test_pipelining.py."""
from __future__ import annotations

import threading

import pytest

from pagewire.scheduler.engine import InProcessExecutor, SocketExecutor
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import StepResult

from .sched_helpers import make_scheduler, new


def plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, [], [], [], [], [], [], [], None, [], [])


def test_the_ledger_holds_each_plan_with_its_rows_and_ticket_until_its_result():
    sched = make_scheduler(depth=2)
    sched.add(new("a", 4))
    first, second = sched.schedule(), sched.schedule()
    engine = sched.engine
    assert engine.plans_in_flight() == [first, second] and engine.num_in_flight == 2
    assert [(str(r.seq_id), n) for r, n in engine.ledger[0].rows] == [("a", 4)]
    assert [(str(r.seq_id), n) for r, n in engine.ledger[1].rows] == [("a", 1)]
    assert list(sched.held.not_run) == [first, second]       # what the handle was sent
    sched.update(first, sched.run())
    assert engine.plans_in_flight() == [second]
    sched.update(second, sched.run())
    assert engine.num_in_flight == 0 and not hasattr(sched.core.sched, "in_flight")


def test_a_result_out_of_order_is_refused_and_changes_nothing():
    sched = make_scheduler(depth=2)
    sched.add(new("a", 4))
    first, second = sched.schedule(), sched.schedule()
    with pytest.raises(RuntimeError, match=f"result for step {second.step_id}, expected "
                                           f"{first.step_id}"):
        sched.engine.handle(StepResult(second.step_id, [], []))
    assert sched.engine.plans_in_flight() == [first, second]
    with pytest.raises(RuntimeError, match="expected None"):
        make_scheduler().engine.handle(StepResult(1, [], []))


@pytest.mark.parametrize("async_scheduling, depth", [(False, 1), (True, 2)])
def test_depth_follows_async_scheduling_and_bounds_the_plans_in_flight(async_scheduling, depth):
    sched = make_scheduler(depth=None, async_scheduling=async_scheduling)
    sched.add(new("a", 4))
    sched.add(new("b", 4))
    plans = [sched.schedule() for _ in range(depth)]
    assert all(p is not None for p in plans) and sched.engine.depth == depth
    assert not sched.engine.can_plan() and sched.schedule() is None
    assert sched.engine.num_in_flight == depth and not sched.engine.stalled


def test_after_finding_nothing_to_plan_it_waits_for_a_message():
    sched = make_scheduler(depth=2)
    sched.add(new("a", 4, max_tokens=1))
    only = sched.schedule()
    assert sched.schedule() is None and sched.engine.stalled     # its one token is in flight
    assert not sched.engine.can_plan() and sched.engine.busy()
    sched.add(new("b", 4))                                      # any message: plan again
    assert not sched.engine.stalled and sched.schedule() is not None
    sched.update(only, sched.run())
    assert sched.engine.has_work() and sched.engine.busy()


def test_with_nothing_in_flight_an_empty_plan_is_retried_at_once():
    sched = make_scheduler()
    assert sched.schedule() is None and not sched.engine.stalled and not sched.engine.busy()


def test_a_lazy_in_process_executor_runs_each_plan_when_its_result_is_asked_in_order():
    ran = []
    handle = InProcessExecutor(lambda p: ran.append(p.step_id) or StepResult(p.step_id, [], []))
    tickets = [handle.send(plan(1)), handle.send(plan(2))]
    assert ran == []
    assert [handle.collect(t).step_id for t in tickets] == [1, 2] and ran == [1, 2]


def test_a_threaded_in_process_executor_runs_plans_on_its_worker_in_order():
    seen, inits = [], []

    def execute(p: StepPlan) -> StepResult:
        seen.append((p.step_id, threading.current_thread().name))
        if p.step_id == 3:
            raise ValueError("boom")
        return StepResult(p.step_id, [], [])
    handle = InProcessExecutor(execute, on_thread=True, thread_init=lambda: inits.append(1))
    tickets = [handle.send(plan(i)) for i in (1, 2, 3)]
    assert [handle.collect(t).step_id for t in tickets[:2]] == [1, 2]
    with pytest.raises(ValueError, match="boom"):             # raised where it is collected
        handle.collect(tickets[2])
    assert [s for s, _ in seen] == [1, 2, 3] and inits == [1]
    assert all(name.startswith("pagewire-executor") for _, name in seen)


def test_a_socket_executor_sends_each_plan_to_every_push_and_collects_nothing():
    class Push(list):
        send = list.append
    pushes = [Push(), Push()]
    handle = SocketExecutor(pushes)
    assert handle.send(plan(1)) is None
    assert pushes == [[plan(1)], [plan(1)]]
    with pytest.raises(RuntimeError, match="inbox"):
        handle.collect(None)


def test_next_result_collects_the_oldest_plans_result_from_the_handle():
    sched = make_scheduler(depth=2)
    with pytest.raises(RuntimeError, match="no plan in flight"):
        sched.engine.next_result()
    sched.add(new("a", 4))
    first = sched.schedule()
    with pytest.raises(AssertionError, match="as over sockets"):   # HeldPlans answers by message
        sched.engine.next_result()
    assert sched.engine.plans_in_flight() == [first]


def test_the_stop_rule_is_one_function_both_sides_call():
    """EOS and stop ids end a sequence in the scheduler (it finishes it) and in the executor
    (a row planned ahead of the stop is not run): one rule, wire.sampling_params.stops_on."""
    from pagewire.executor import seq_table
    from pagewire.scheduler import request
    from pagewire.wire import sampling_params as sampling
    assert seq_table.stops_on is sampling.stops_on and request.stops_on is sampling.stops_on
