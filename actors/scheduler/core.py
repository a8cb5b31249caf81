"""The scheduler core: the scheduler's behaviour as messages in, messages out, with no I/O.

The step engine (engine.py) runs it: handle() takes an inbox message other than a step result
(NewRequest, PromptPiece, Abort, AbortAll, KvLeaseEnded, KvPulled, DetokenizerStarted) and
returns what to send where; plan() makes the next StepPlan with the rows the scheduler needs back
with its result; apply() takes that result. Which plans are in flight, and when to plan ahead, is
the engine's. Every delta to the detokenizer is also recorded (detok_record.py): a restarted
detokenizer is rebuilt from it, and a NewRequest already held or lately ended is ignored.
"""
from __future__ import annotations

from pagewire.wire.channels import Sends
from pagewire.wire.kv_transfer import KvLeaseEnded, KvPulled
from pagewire.wire.to_detokenizer import TokenDelta, TokenDeltas
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import (Abort, AbortAll, DetokenizerStarted, NewRequest,
                                        PromptPiece, StepResult)

from ..config import EngineConfig
from .detok_record import DetokRecord
from .scheduler import Scheduler, StepRows


class SchedulerCore:
    def __init__(self, config: EngineConfig, tier_present: list[bytes] | None = None):
        self.config = config
        self.sched = Scheduler(config, tier_present)
        self.detok_record = DetokRecord()
        self.handlers = {NewRequest: self._add, PromptPiece: self._extend,
                         Abort: lambda m: self.sched.abort(m.seq_ids),
                         AbortAll: lambda m: self.sched.abort_all(),
                         KvLeaseEnded: self.sched.end_lease, KvPulled: self.sched.pulled}

    def has_work(self) -> bool:
        return self.sched.has_work()

    def waiting_for_pulls(self) -> bool:
        """Sequences wait for blocks a prefill engine's KV is being pulled into."""
        return bool(self.sched.arrivals.pulling)

    def plan(self, steps_in_flight: int) -> tuple[StepPlan, StepRows] | None:
        """The next step to run and its rows, or None (nothing to run now)."""
        return self.sched.schedule(steps_in_flight)

    def handle(self, msg) -> Sends:
        """msg: one of SchedulerInbox's types (wire/to_scheduler.py) except StepResult."""
        if isinstance(msg, DetokenizerStarted):
            return [("detokenizer", self.detok_record.resync())]
        return self._to_detokenizer(self.handlers[type(msg)](msg))

    def apply(self, plan: StepPlan, rows: StepRows, result: StepResult) -> Sends:
        """The executor's result for `plan` (the oldest in flight)."""
        return self._to_detokenizer(self.sched.update(plan, rows, result))

    def _add(self, msg: NewRequest) -> list[TokenDelta]:
        """A new request; a duplicate (resent after a tokenizer died) is ignored."""
        return self.sched.add(msg) if self.detok_record.opened(msg) else []

    def _extend(self, msg: PromptPiece) -> list[TokenDelta]:
        self.detok_record.grew(msg)
        return self.sched.extend(msg)

    def _to_detokenizer(self, deltas: list[TokenDelta]) -> Sends:
        self.detok_record.sent(deltas)
        return [("detokenizer", TokenDeltas(deltas))] if deltas else []
