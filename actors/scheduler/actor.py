"""The scheduler actor: the step loop.

    drain inbox (NewRequest, Abort, StepResult) -> schedule() -> plan to every executor
    -> ... StepResult -> update() -> TokenDeltas to the detokenizer

One plan is in flight at a time. The inbox is drained without blocking while there is work to
plan, and blocks when waiting for a result or when idle.
"""
from __future__ import annotations

from pagewire.wire.channels import PullChannel, PushChannel
from pagewire.wire.to_detokenizer import TokenDelta, TokenDeltas
from pagewire.wire.to_scheduler import Abort, NewRequest, SchedulerInbox, StepResult

from .scheduler import Scheduler


class SchedulerLoop:
    def __init__(self, env):
        self.sched = Scheduler(env.config)
        self.inbox = PullChannel(env.ctx, env.address("scheduler"), SchedulerInbox)
        self.executors = [PushChannel(env.ctx, env.address("executor-0"))]
        self.detokenizer = PushChannel(env.ctx, env.address("detokenizer"))
        self.in_flight: int | None = None     # step id of the plan being run
        self.handlers = {NewRequest: self.on_new, Abort: self.on_abort, StepResult: self.on_result}

    def run(self) -> None:
        while True:
            can_plan = self.in_flight is None and self.sched.has_work()
            msg = self.inbox.recv(0 if can_plan else None)
            while msg is not None:
                self.handlers[type(msg)](msg)
                msg = self.inbox.recv(0)
            if self.in_flight is None:
                self.plan()

    def plan(self) -> None:
        plan = self.sched.schedule()
        if plan is None:
            return
        self.in_flight = plan.step_id
        for executor in self.executors:
            executor.send(plan)

    def on_new(self, msg: NewRequest) -> None:
        self.emit(self.sched.add(msg))

    def on_abort(self, msg: Abort) -> None:
        self.emit(self.sched.abort(msg.req_ids))

    def on_result(self, msg: StepResult) -> None:
        if msg.step_id != self.in_flight:
            raise RuntimeError(f"result for step {msg.step_id}, expected {self.in_flight}")
        self.in_flight = None
        self.emit(self.sched.update(msg))

    def emit(self, deltas: list[TokenDelta]) -> None:
        if deltas:
            self.detokenizer.send(TokenDeltas(deltas))


def run(env) -> None:
    loop = SchedulerLoop(env)
    env.ready()
    loop.run()
