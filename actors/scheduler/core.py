"""The scheduler core: the scheduler's behaviour as messages in, messages out, with no I/O.

The scheduler actor's loop, `pagewire replay` and the offline `LLM` drive this one object:
handle() takes an inbox message (NewRequest, Abort, AbortAll, StepResult) and returns what to
send where; plan() returns the next StepPlan for the executors, or None.

Pipelined steps (`async_scheduling`): up to two plans are in flight, so the scheduler plans
step N+1 while the executor runs step N; the executor runs plans in order and their results
come back in that order. A plan made with another in flight assumes one more token for each
sequence that samples in it (scheduler.py), so sequences that cannot be planned ahead (beams,
whose next token the scheduler picks; a prompt about to fork into n sequences) simply wait a
step: they run one plan in flight at a time. Without async_scheduling one plan is in flight.
"""
from __future__ import annotations

from collections import deque

from pagewire.wire.channels import Sends
from pagewire.wire.kv_transfer import KvLeaseEnded, KvPulled
from pagewire.wire.to_detokenizer import TokenDelta, TokenDeltas
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import Abort, AbortAll, NewRequest, PromptPiece, StepResult

from ..config import EngineConfig
from .scheduler import Scheduler


class SchedulerCore:
    def __init__(self, config: EngineConfig, depth: int | None = None,
                 tier_present: list[bytes] | None = None):
        self.sched = Scheduler(config, tier_present)
        self.depth = depth or (2 if config.async_scheduling else 1)   # plans in flight, at most
        self.in_flight: deque[StepPlan] = deque()
        # Set when planning found nothing to run while a plan is in flight: only a message
        # (that plan's result, an arrival, an abort) can change that, so do not retry before.
        self.stalled = False
        self.handlers = {NewRequest: self.sched.add, PromptPiece: self.sched.extend,
                         Abort: lambda m: self.sched.abort(m.seq_ids),
                         AbortAll: lambda m: self.sched.abort_all(), StepResult: self._on_result,
                         KvLeaseEnded: self.sched.end_lease, KvPulled: self.sched.pulled}

    def can_plan(self) -> bool:
        return len(self.in_flight) < self.depth and not self.stalled and self.sched.has_work()

    def busy(self) -> bool:
        return bool(self.in_flight) or self.sched.has_work()

    def plan(self) -> StepPlan | None:
        """The next step to run, or None (nothing to run now, or enough plans in flight)."""
        if not self.can_plan():
            return None
        plan = self.sched.schedule()
        if plan is None:
            # With nothing in flight a retry may succeed (a step that only preempted).
            self.stalled = bool(self.in_flight)
            return None
        self.in_flight.append(plan)
        return plan

    def handle(self, msg) -> Sends:
        """msg: one of SchedulerInbox's types (wire/to_scheduler.py)."""
        self.stalled = False
        deltas = self.handlers[type(msg)](msg)
        return [("detokenizer", TokenDeltas(deltas))] if deltas else []

    def _on_result(self, result: StepResult) -> list[TokenDelta]:
        expected = self.in_flight[0].step_id if self.in_flight else None
        if result.step_id != expected:
            raise RuntimeError(f"result for step {result.step_id}, expected {expected}")
        return self.sched.update(self.in_flight.popleft(), result)
