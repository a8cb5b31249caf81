"""The scheduler core: the scheduler's behaviour as messages in, messages out, with no I/O.

The scheduler actor's loop, `pagewire replay` and the offline `LLM` drive this one object:
handle() takes an inbox message (NewRequest, Abort, AbortAll, StepResult) and returns what to
send where; plan() returns the next StepPlan for the executors, or None. Invariant: at most
one plan is in flight; its StepResult must come back (through handle) before the next plan.
"""
from __future__ import annotations

from pagewire.wire.channels import Sends
from pagewire.wire.to_detokenizer import TokenDelta, TokenDeltas
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import Abort, AbortAll, NewRequest, StepResult

from ..config import EngineConfig
from .scheduler import Scheduler


class SchedulerCore:
    def __init__(self, config: EngineConfig):
        self.sched = Scheduler(config)
        self.in_flight: StepPlan | None = None
        self.handlers = {NewRequest: self.sched.add, Abort: lambda m: self.sched.abort(m.req_ids),
                         AbortAll: lambda m: self.sched.abort_all(), StepResult: self._on_result}

    def can_plan(self) -> bool:
        return self.in_flight is None and self.sched.has_work()

    def plan(self) -> StepPlan | None:
        """The next step to run, or None (nothing to run, or a plan still in flight)."""
        if not self.can_plan():
            return None
        self.in_flight = self.sched.schedule()
        return self.in_flight

    def handle(self, msg: NewRequest | Abort | AbortAll | StepResult) -> Sends:
        deltas = self.handlers[type(msg)](msg)
        return [("detokenizer", TokenDeltas(deltas))] if deltas else []

    def _on_result(self, result: StepResult) -> list[TokenDelta]:
        plan = self.in_flight
        if plan is None or result.step_id != plan.step_id:
            expected = None if plan is None else plan.step_id
            raise RuntimeError(f"result for step {result.step_id}, expected {expected}")
        self.in_flight = None
        return self.sched.update(plan, result)
