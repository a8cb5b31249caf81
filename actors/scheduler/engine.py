"""The step engine: plan -> execute -> result, written once for every driver.

    engine.handle(msg)   an inbox message (NewRequest, Abort, StepResult, ...) -> what to send
    engine.plan()        the next StepPlan, already handed to the executor; None: nothing now
    engine.next_result() an in-process executor's result for the oldest plan in flight

The engine owns the ledger of plans in flight, the only record of them: each entry is the plan,
the scheduler's rows for it (which sequences it ran, for how many tokens) and the executor
handle's ticket. It owns the rule for planning ahead: with `async_scheduling` up to two plans
are in flight, so step N+1 is planned while step N runs; the executor runs plans in order and
their results come back in that order. A plan made with another in flight assumes one more
token for each sequence that samples in it (scheduler.py), so sequences that cannot be planned
ahead (beams, whose next token the scheduler picks; a prompt about to fork into n sequences)
simply wait a step. Without async_scheduling one plan is in flight.

Three drivers move messages to and from it and read nothing else: the scheduler actor's loop
(actor.py: sockets, results in the inbox), `pagewire replay` (replay.py: a recorded inbox, an
in-process executor) and the offline LLM (llm.py: in-process queues, the executor on a worker
thread when pipelining: executor/step_overlap.py's OverlappedExecutor where the executor
overlaps its steps, else InProcessExecutor's).

Sleep mode's controls (core.py control_due) enter the ledger like plans: sent in the place of
the next plan once nothing is in flight, answered by a ControlDone in the result's place.

Executor handles: `send(plan)` returns a ticket kept in the ledger; `collect(ticket)` waits for
that plan's StepResult. Over sockets results come back as inbox messages instead, so collect is
never called. This module imports neither torch nor the executor (the scheduler process starts
without them): an in-process handle is given the runner's execute function.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from pagewire.wire.channels import Sends
from pagewire.wire.engine_control import ControlDone, EngineControl
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import StepResult

from .core import SchedulerCore
from .scheduler import Scheduler, StepRows


class ExecutorHandle(Protocol):
    def send(self, plan: StepPlan) -> Any:
        """Hand the executor a plan (plans run in the order sent); returns its ticket."""

    def collect(self, ticket: Any) -> StepResult:
        """Wait for the result of the plan `ticket` was returned for."""


class SocketExecutor:
    """Executors in other processes: plans go to executor-0's push channel (it forwards them
    to ranks 1..N-1); results arrive as StepResult messages in the scheduler's inbox."""

    def __init__(self, pushes: list):
        self.pushes = pushes

    def send(self, plan: StepPlan) -> None:
        for push in self.pushes:
            push.send(plan)

    def collect(self, ticket: None) -> StepResult:
        raise RuntimeError("an executor over sockets answers in the inbox")


class InProcessExecutor:
    """The executor in this process: `execute(plan)` runs a step (ModelRunner.execute).

    On a worker thread (`on_thread`, for async scheduling) the next step is planned, and the
    last one's tokens detokenized, while a step runs. Else a plan runs when its result is first
    asked for: plans still run in the order sent, since results are collected oldest first.
    OpenMP keeps a thread team per calling thread, and once a second thread had run the steps,
    a CPU step took twice as long on two cores (bench/NOTES.md "Threads and OpenMP teams"): so
    the worker exists only with on_thread, and `thread_init` (the caller's
    torch.set_num_threads) gives it the calling thread's OpenMP thread count. An exception
    from a step is raised by collect."""

    def __init__(self, execute: Callable[[StepPlan], StepResult], on_thread: bool = False,
                 thread_init: Callable[[], None] | None = None):
        self.execute = execute
        self.worker = ThreadPoolExecutor(1, "pagewire-executor", initializer=thread_init) \
            if on_thread else None

    def send(self, plan: StepPlan) -> Future | StepPlan:
        if self.worker is not None:
            return self.worker.submit(self.execute, plan)
        return plan

    def collect(self, ticket: Future | StepPlan) -> StepResult:
        if isinstance(ticket, Future):
            return ticket.result()
        return self.execute(ticket)


@dataclass
class InFlight:
    """One entry of the ledger: a plan (or sleep-mode control) sent, not yet answered."""
    plan: StepPlan | EngineControl
    rows: StepRows           # the scheduler's: what it scheduled in the plan
    ticket: Any              # the executor handle's


class StepEngine:
    def __init__(self, core: SchedulerCore, executor: ExecutorHandle, depth: int | None = None):
        self.core = core
        self.executor = executor
        # Plans in flight, at most:
        self.depth = depth or (2 if core.config.scheduler.async_scheduling else 1)
        self.ledger: deque[InFlight] = deque()
        # Set when planning found nothing to run while a plan is in flight: only a message
        # (that plan's result, an arrival, an abort) can change that, so do not retry before.
        self.stalled = False

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler's state, for metrics and inspection (read, never driven)."""
        return self.core.sched

    # -- what drivers ask --------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self.ledger)

    def plans_in_flight(self) -> list[StepPlan]:
        """The plans sent and not yet answered, oldest first."""
        return [entry.plan for entry in self.ledger]

    def has_work(self) -> bool:
        """Something to plan (sequences, or tier and lease work a plan carries alone)."""
        return self.core.has_work()

    def can_plan(self) -> bool:
        return len(self.ledger) < self.depth and not self.stalled and self.core.has_work()

    def busy(self) -> bool:
        return bool(self.ledger) or self.core.busy()

    def waiting_for_arrivals(self) -> bool:
        """Nothing can run until a prefill engine's blocks arrive (or fail to): only a KvPulled
        message moves it on."""
        return self.core.waiting_for_pulls()

    # -- the step ----------------------------------------------------------------------------

    def plan(self) -> StepPlan | EngineControl | None:
        """Plan the next step and send it to the executor; None when nothing can run now or
        enough plans are in flight. A sleep-mode control due now goes instead."""
        control = self.core.control_due(len(self.ledger))
        if control is not None:
            self.ledger.append(InFlight(control, [], self.executor.send(control)))
            return control
        if not self.can_plan():
            return None
        planned = self.core.plan(len(self.ledger))
        if planned is None:
            # With nothing in flight a retry may succeed (a step that only preempted).
            self.stalled = bool(self.ledger)
            return None
        plan, rows = planned
        self.ledger.append(InFlight(plan, rows, self.executor.send(plan)))
        return plan

    def next_result(self) -> StepResult:
        """Wait for the oldest plan's result from an in-process executor (hand it to handle())."""
        if not self.ledger:
            raise RuntimeError("no plan in flight")
        return self.executor.collect(self.ledger[0].ticket)

    def handle(self, msg) -> Sends:
        """msg: one of SchedulerInbox's types (wire/to_scheduler.py)."""
        self.stalled = False
        if isinstance(msg, ControlDone):
            if not self.ledger or getattr(self.ledger[0].plan, "req_id", None) != msg.req_id:
                raise RuntimeError(f"control answer {msg.req_id} with no such control in flight")
            self.ledger.popleft()
            return self.core.control_done(msg)
        if not isinstance(msg, StepResult):
            return self.core.handle(msg)
        expected = getattr(self.ledger[0].plan, "step_id", None) if self.ledger else None
        if msg.step_id != expected:
            raise RuntimeError(f"result for step {msg.step_id}, expected {expected}")
        entry = self.ledger.popleft()
        return self.core.apply(entry.plan, entry.rows, msg)
