"""Warm spares (--warm-spares): a loaded process per stateless role, promoted when one dies.

Most of a tokenizer's start is importing transformers and loading the model's tokenizer; a
spare has done both (process.py: `python -m pagewire.process ROLE CONFIG spare`) and waits on
its stdin. The supervisor's restart of a dead tokenizer or detokenizer takes the spare in its
place, writing it the index it serves as, so the actor binds its inbox and says Ready within a
fraction of its cold start; a fresh spare for the next death starts once the supervisor is
back to watching (refill), off the restart's critical path. A spare that fails before its
promotion is not restarted for that role again (its prepare failed, and a cold start will
say why); one killed by a signal is.
"""
from __future__ import annotations

import logging
import subprocess
from typing import Callable

log = logging.getLogger("supervisor")
ROLES = ("tokenizer", "detokenizer")


class WarmSpares:
    def __init__(self, command: Callable[[str], list[str]], roles: tuple[str, ...] = ROLES):
        """command(role): the spare's command line."""
        self.command, self.roles = command, roles
        self.spares: dict[str, subprocess.Popen] = {}
        self.failed: set[str] = set()          # roles whose spare died unpromoted

    def refill(self) -> None:
        """A spare for every role that has none."""
        for role in self.roles:
            spare = self.spares.get(role)
            if spare is not None and spare.poll() is not None:
                del self.spares[role]
                if spare.returncode > 0:      # its prepare failed (killed by a signal: again)
                    log.warning("the spare %s exited with code %d; no more spares for it",
                                role, spare.returncode)
                    self.failed.add(role)
            if role not in self.spares and role not in self.failed:
                self.spares[role] = subprocess.Popen(self.command(role), stdin=subprocess.PIPE)

    def take(self, role: str, index: int) -> subprocess.Popen | None:
        """The spare of `role`, now serving as `index`; None when there is none alive."""
        spare = self.spares.pop(role, None)
        if spare is None or spare.poll() is not None:
            return None
        try:
            spare.stdin.write(f"{index}\n".encode())
            spare.stdin.close()
        except OSError:                   # it died as it was promoted: a cold start instead
            return None
        return spare

    def stop(self) -> list[subprocess.Popen]:
        """Every spare, handed back to be stopped like an actor (STOP_SIGNAL)."""
        spares = list(self.spares.values())
        self.spares.clear()
        return spares
