"""The gateway's tokenizers, and what each holds: a dead tokenizer's requests are resent.

Each tokenizer has its own socket, and the pool picks one per message (in turn, skipping the
ones the supervisor said were lost), so the gateway knows which tokenizer holds what. A
message stays in `held` until its first answer comes back (a RequestFailed, a TokenizeReply
or DetokenizeReply, or a TextDelta of one of its outputs). When the supervisor says a
tokenizer died (EngineEvent "lost"), its socket is replaced (frames still queued for the dead
process are dropped) and every message it held whose client still waits is resent to a live
tokenizer, or, with none, to the restarting one (its socket queues until the new process
listens).

A resent prompt may already have been passed on by the dead tokenizer (the gateway cannot
tell: the NewRequest and any acknowledgement would leave on different sockets, and a SIGKILL
between the two loses one), so copies are made harmless downstream instead: the scheduler
ignores a NewRequest whose id it holds or ended lately (scheduler/detok_record.py) and the
detokenizer a DetokStart of an output live or over.

A streamed prompt (stream_input.py) is pinned to tokenizer 0, its pieces after it on the same
socket (the scheduler must see the request before its pieces, and these in order). The
gateway keeps no pieces, so it cannot resend one: until its first answer, a streamed prompt
whose tokenizer died fails (503) instead.
"""
from __future__ import annotations

import logging
from typing import Callable

import msgspec
import zmq

from pagewire.wire.channels import PushChannel
from pagewire.wire.to_gateway import EngineEvent
from pagewire.wire.to_tokenizer import TokenizePiece, TokenizeRequest

log = logging.getLogger(__name__)


class TokenizerPool:
    def __init__(self, ctx: zmq.Context, address: Callable[[str], str], count: int,
                 tracer=None):
        self.ctx, self.address, self.tracer = ctx, address, tracer
        self.channels = [self._connect(i) for i in range(count)]
        self.down: set[int] = set()
        self.held: dict[str, tuple[int, msgspec.Struct]] = {}   # req id -> (tokenizer, message)
        self.pinned: set[str] = set()      # of those, streamed prompts: failed, not resent
        self.turn = 0

    def _connect(self, index: int) -> PushChannel:
        return PushChannel(self.ctx, self.address(f"tokenizer-{index}"), tracer=self.tracer,
                           name="tokenizer")

    def send(self, msg) -> None:
        """To the next live tokenizer (any of them, while all are restarting); held there
        until answered."""
        count = len(self.channels)
        live = [i for i in range(count) if i not in self.down] or list(range(count))
        index = live[self.turn % len(live)]
        self.turn += 1
        self.held[msg.req_id] = (index, msg)
        self.channels[index].send(msg)

    def send_pinned(self, msg: TokenizeRequest | TokenizePiece) -> None:
        """A streamed prompt, or one of its pieces, to tokenizer 0 (the prompt held there
        until answered, to be failed if it dies)."""
        if isinstance(msg, TokenizeRequest):
            self.held[msg.req_id] = (0, msg)
            self.pinned.add(msg.req_id)
        self.channels[0].send(msg)

    def answered(self, req_id: str) -> None:
        if self.held.pop(req_id, None) is not None:
            self.pinned.discard(req_id)

    def on_event(self, event: EngineEvent, waiting: Callable[[str], bool]) -> list[str]:
        """A supervisor's event; returns the requests to fail (streamed prompts a lost
        tokenizer held). The supervisor ends a recovery ("back", "up") only once every actor
        it started has said Ready, so then every tokenizer serves: one whose restart another
        actor's death interrupted never gets a "back" of its own."""
        if event.status in ("back", "up"):
            self.down.clear()
        elif event.status == "lost" and event.actor.startswith("tokenizer "):
            return self.lost(int(event.actor.split()[1]), waiting)
        return []

    def lost(self, index: int, waiting: Callable[[str], bool]) -> list[str]:
        """Tokenizer `index` died: resend what it held to the others; `waiting(req_id)` says
        whether a client still waits for it. Returns the streamed prompts it held, to fail."""
        if not 0 <= index < len(self.channels):
            return []
        self.down.add(index)
        old = self.channels[index]
        old.sock.setsockopt(zmq.LINGER, 0)
        old.close()
        self.channels[index] = self._connect(index)
        orphans = [msg for rid, (i, msg) in list(self.held.items()) if i == index]
        failed = []
        for msg in orphans:
            del self.held[msg.req_id]
            if msg.req_id in self.pinned:
                self.pinned.discard(msg.req_id)
                failed.append(msg.req_id)
            elif waiting(msg.req_id):
                self.send(msg)
        log.warning("tokenizer %d died: %d requests resent, %d streamed prompts failed", index,
                    sum(1 for m in orphans if m.req_id in self.held), len(failed))
        return [rid for rid in failed if waiting(rid)]

    def forget_gone(self, waiting: Callable[[str], bool]) -> None:
        """Drop held messages whose clients went away (their handlers ended)."""
        for rid in [rid for rid in self.held if not waiting(rid)]:
            del self.held[rid]
            self.pinned.discard(rid)
