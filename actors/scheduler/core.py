"""The scheduler core: the scheduler's behaviour as messages in, messages out, with no I/O.

The step engine (engine.py) runs it: handle() takes an inbox message other than a step result
(NewRequest, PromptPiece, Abort, AbortAll, KvLeaseEnded, KvPulled, DetokenizerStarted) and
returns what to send where; plan() makes the next StepPlan with the rows the scheduler needs back
with its result; apply() takes that result. Which plans are in flight, and when to plan ahead, is
the engine's. Sleep mode's controls (SleepEngine, WakeEngine, UpdateWeights) are handled here too
(engine_pause.py): control_due() hands the engine a control to send in the place of a plan,
control_done() takes the executors' answer. Every delta to the detokenizer is also recorded
(detok_record.py): a restarted detokenizer is rebuilt from it, and a NewRequest already held or
lately ended is ignored.
"""
from __future__ import annotations

from pagewire.wire.channels import Sends
from pagewire.wire.engine_control import (ControlDone, EngineControl, SleepEngine,
                                          UpdateWeights, WakeEngine)
from pagewire.wire.ids import output_ids
from pagewire.wire.kv_events import KVEventBatch
from pagewire.wire.kv_transfer import KvLeaseEnded, KvPulled
from pagewire.wire.to_detokenizer import TokenDelta, TokenDeltas
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import (Abort, AbortAll, DetokenizerStarted, NewRequest,
                                        PromptPiece, StepResult)

from ..config import EngineConfig
from .detok_record import DetokRecord
from .engine_pause import EnginePause
from .kv_event_log import KvEventLog
from .scheduler import Scheduler, StepRows


class SchedulerCore:
    def __init__(self, config: EngineConfig, tier_present: list[bytes] | None = None):
        self.config = config
        self.sched = Scheduler(config, tier_present)
        self.pause = EnginePause(self.sched)
        self.detok_record = DetokRecord()
        events = config.kv_events_config
        if events is not None and events.publishes:      # the device pool reports to it
            self.sched.kv.events = KvEventLog(config.cache.block_size)
        self.handlers = {NewRequest: self._add, PromptPiece: self._extend,
                         Abort: lambda m: self.sched.abort(m.seq_ids),
                         AbortAll: lambda m: self.sched.abort_all(),
                         KvLeaseEnded: self.sched.end_lease, KvPulled: self.sched.pulled}

    def has_work(self) -> bool:
        return self.sched.has_work()

    def busy(self) -> bool:
        """Work to plan, or a control waiting to be sent or answered."""
        return self.sched.has_work() or self.pause.busy

    def waiting_for_pulls(self) -> bool:
        """Sequences wait for blocks a prefill engine's KV is being pulled into."""
        return bool(self.sched.arrivals.pulling)

    def plan(self, steps_in_flight: int) -> tuple[StepPlan, StepRows] | None:
        """The next step to run and its rows, or None (nothing to run now)."""
        return self.sched.schedule(steps_in_flight)

    def handle(self, msg) -> Sends:
        """msg: one of SchedulerInbox's types (wire/to_scheduler.py) except StepResult and
        ControlDone."""
        if isinstance(msg, DetokenizerStarted):
            return [("detokenizer", self.detok_record.resync())]
        if isinstance(msg, (SleepEngine, WakeEngine, UpdateWeights)):
            ended, answer = self.pause.begin(msg)
            return self._to_detokenizer(ended) + ([("gateway", answer)] if answer else [])
        return self._to_detokenizer(self.handlers[type(msg)](msg))

    def _add(self, msg: NewRequest) -> list[TokenDelta]:
        """A new request, refused (finish reason "rejected") while the engine sleeps or
        pauses for a control; a duplicate (resent after a tokenizer died) is ignored."""
        if not self.detok_record.opened(msg):
            return []
        refusal = self.pause.refusal()
        if refusal is None:
            return self.sched.add(msg)
        return [TokenDelta(o, [], "rejected", refusal)
                for o in output_ids(msg.req_id, msg.sampling.num_outputs)]

    def _extend(self, msg: PromptPiece) -> list[TokenDelta]:
        self.detok_record.grew(msg)
        return self.sched.extend(msg)

    def control_due(self, plans_in_flight: int) -> EngineControl | None:
        """A control to send the executors now, in the place of a plan (engine_pause.py)."""
        return self.pause.due(plans_in_flight)

    def control_done(self, msg: ControlDone) -> Sends:
        """The executors' answer to the control sent: to the gateway."""
        return [("gateway", self.pause.done(msg))]

    def take_kv_events(self) -> KVEventBatch | None:
        """The prefix cache's events since the last call (--kv-events-config), or None."""
        events = self.sched.kv.events
        return events.take() if events is not None else None

    def apply(self, plan: StepPlan, rows: StepRows, result: StepResult) -> Sends:
        """The executor's result for `plan` (the oldest in flight)."""
        return self._to_detokenizer(self.sched.update(plan, rows, result))

    def _to_detokenizer(self, deltas: list[TokenDelta]) -> Sends:
        self.detok_record.sent(deltas)
        return [("detokenizer", TokenDeltas(deltas))] if deltas else []
