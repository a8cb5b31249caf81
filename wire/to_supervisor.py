"""Messages the supervisor receives from the actors it started."""
from __future__ import annotations

import msgspec


class Ready(msgspec.Struct, tag=True):
    actor: str          # e.g. "executor 0", "scheduler"
    pid: int


class Fatal(msgspec.Struct, tag=True):
    """An actor hit an error it cannot recover from; it exits right after sending this."""
    actor: str
    message: str


SupervisorInbox = Ready | Fatal
