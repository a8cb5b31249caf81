"""Messages the supervisor receives from the actors it started."""
from __future__ import annotations

import msgspec


class Ready(msgspec.Struct, tag=True):
    actor: str          # e.g. "executor 0", "scheduler"
    pid: int
    backend: str = ""   # an executor's kernel backend as it runs, e.g. "cpu-avx2", "triton"


class Fatal(msgspec.Struct, tag=True):
    """An actor hit an error it cannot recover from; it exits right after sending this."""
    actor: str
    message: str
    pid: int = 0        # which instance of the actor (a late Fatal of a replaced one is stale)


class Heartbeat(msgspec.Struct, tag=True):
    """An actor's loop is alive: sent about once a second, busy or idle. The scheduler adds
    how long the step now in flight has run (a hung executor shows there)."""
    actor: str
    step_running_for: float = 0.0


SupervisorInbox = Ready | Fatal | Heartbeat
