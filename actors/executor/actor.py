"""The executor actor: receive a StepPlan, run it, return the StepResult (rank 0 only)."""
from __future__ import annotations

import logging
import traceback

from pagewire.wire.to_executor import ExecutorInbox
from pagewire.wire.to_scheduler import StepResult

from .runner import ModelRunner

log = logging.getLogger(__name__)


def run(env) -> None:
    runner = ModelRunner(env.config)
    inbox = env.pull(f"executor-{env.index}", ExecutorInbox)
    results = env.push("scheduler")
    env.ready()
    while True:
        plan = inbox.recv(timeout_ms=1000)
        env.heartbeat()          # a step that hangs stops these: the supervisor notices
        if plan is None:
            continue
        try:
            result = runner.execute(plan)
        except Exception as e:
            # The step's requests fail; the executor lives on (the scheduler drops their state).
            log.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            result = StepResult(plan.step_id, [], [], error=f"{type(e).__name__}: {e}")
        results.send(result)
