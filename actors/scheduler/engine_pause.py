"""Sleep mode in the scheduler: the control in progress (sleep, wake up, new weights) and what
the executors hold asleep (wire/engine_control.py).

A control comes from the gateway (or the offline LLM). With mode "abort" every request ends at
once (each output gets its final "abort" delta); with "wait" the requests already here run to
their end. Either way no new request is admitted from then on: it is refused at arrival
(finish reason "rejected", a 503 at the gateway, as vLLM answers while sleeping) until the
control is done, and for as long as anything is asleep. Once no request is left and no plan is
in flight, the control goes to the executors in the place of a plan, with the prefix cache
cleared first (the pool's content is about to be forgotten, or was computed by other weights)
and the executors' sequence state with it. The executors' ControlDone ends it.

Invariants: at most one control pending; while a control is sent or anything is asleep, the
scheduler holds no request and no block.
"""
from __future__ import annotations

from pagewire.wire.engine_control import (ABORT, MODES, TAGS, ControlDone, EngineControl,
                                          SleepEngine, WakeEngine)
from pagewire.wire.to_detokenizer import TokenDelta

from .scheduler import Scheduler


class EnginePause:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.pending: EngineControl | None = None
        self.sent = False               # the pending control went to the executors
        self.aborted = 0                # requests the pending control ended
        self.asleep: list[str] = []     # TAGS the executors hold asleep

    def refusal(self) -> str | None:
        """Why a new request is refused now, or None."""
        if self.asleep:
            return f"the model is sleeping ({', '.join(self.asleep)} asleep): POST /wake_up first"
        if self.pending is not None:
            return "the engine is pausing for a sleep or weight update: retry shortly"
        return None

    def begin(self, msg: EngineControl) -> tuple[list[TokenDelta], ControlDone | None]:
        """Take a control: the deltas of the requests it ends, and its answer when it is
        answered at once (refused, or nothing to do) rather than by the executors."""
        problem = self._problem(msg)
        if problem is not None:
            return [], ControlDone(req_id=msg.req_id, asleep=self.asleep, status=problem[0],
                                   error=problem[1])
        if isinstance(msg, WakeEngine) and not set(msg.tags or TAGS) & set(self.asleep):
            return [], ControlDone(req_id=msg.req_id, asleep=self.asleep)    # awake already
        if isinstance(msg, SleepEngine) and set(self.asleep) == set(TAGS):
            return [], ControlDone(req_id=msg.req_id, asleep=self.asleep)    # asleep already
        self.pending, self.sent = msg, False
        ended = []
        if getattr(msg, "mode", None) == ABORT:
            self.aborted = len(self.sched.requests)
            ended = self.sched.abort_all()
        return ended, None

    def _problem(self, msg: EngineControl) -> tuple[int, str] | None:
        if self.pending is not None:
            return 409, "another sleep, wake-up or weight update is in progress"
        if isinstance(msg, SleepEngine) and msg.level not in (1, 2):
            return 400, f"sleep level must be 1 or 2, got {msg.level}"
        if getattr(msg, "mode", None) not in (None, *MODES):
            return 400, f"mode must be one of {', '.join(MODES)}, got {msg.mode!r}"
        if isinstance(msg, WakeEngine) and set(msg.tags) - set(TAGS):
            return 400, f"wake_up tags are {' and '.join(TAGS)}, got {', '.join(msg.tags)}"
        return None

    def due(self, plans_in_flight: int) -> EngineControl | None:
        """The pending control, once it can go to the executors (no request left, no plan in
        flight); the prefix cache and the dropped sequences' ids are cleared as it goes."""
        if self.pending is None or self.sent or plans_in_flight or self.sched.requests:
            return None
        self.sent = True
        self.sched.tables.reset_prefix_cache()
        self.sched.to_drop.clear()           # the executors forget every sequence (seq_table)
        self.sched.preempted_ids.clear()
        return self.pending

    def done(self, msg: ControlDone) -> ControlDone:
        """The executors' answer to the control sent; what the gateway is told."""
        self.asleep = list(msg.asleep)
        msg.aborted, self.aborted = self.aborted, 0
        self.pending, self.sent = None, False
        return msg

    @property
    def busy(self) -> bool:
        """A control waits to be sent or answered."""
        return self.pending is not None
