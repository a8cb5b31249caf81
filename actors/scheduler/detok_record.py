"""The scheduler's record of what it sent the detokenizer, to rebuild a restarted one.

The detokenizer holds each output's text state (its decoder, stop strings, how much text went
out); when it dies that state is gone, and so are the deltas in its sockets. The scheduler
holds the tokens: this record keeps, per request, the DetokStart the tokenizer made (rebuilt
from the NewRequest by the same function, wire/to_detokenizer.py detok_start) and every
output's tokens as sent in TokenDeltas, until the request ended, and RETAIN_ENDED_S after
(its last deltas may have died in the detokenizer's sockets before the gateway had them). A
(re)started detokenizer says DetokenizerStarted and gets all of it in one DetokResync.

It also makes NewRequest idempotent: a request id it holds or ended lately is a duplicate
(the gateway resends what a dead tokenizer held, which may have passed it on already) and is
ignored, with no delta, so the copy neither runs twice nor ends the original.
"""
from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from typing import Callable

import msgspec

from pagewire.wire.ids import SeqId, output_ids
from pagewire.wire.to_detokenizer import (DetokResync, DetokStart, OutputTokens, TokenDelta,
                                          detok_start)
from pagewire.wire.to_scheduler import NewRequest, PromptPiece

# How long an ended request's outputs stay rebuildable: far longer than a detokenizer takes to
# be noticed dead and restarted, and than a dead tokenizer's prompts take to be resent.
RETAIN_ENDED_S = 30.0


class RequestRecord:
    """One request as the detokenizer learned it: its start, its outputs' tokens and finals."""

    __slots__ = ("start", "tokens", "finals", "ended_at")

    def __init__(self, start: DetokStart):
        self.start = start
        self.tokens: dict[SeqId, array] = {o: array("i") for o in
                                           output_ids(start.req_id, start.num_outputs)}
        # output -> (reason, error, pooled vector)
        self.finals: dict[SeqId, tuple[str, str | None, bytes | None]] = {}
        self.ended_at: float | None = None

    def outputs(self) -> list[OutputTokens]:
        return [OutputTokens(o, list(t), *self.finals.get(o, (None, None, None)))
                for o, t in self.tokens.items()]


class DetokRecord:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.requests: dict[str, RequestRecord] = {}      # by request id, live or ended lately
        self.open: dict[SeqId, array] = {}     # outputs not ended: their records' token arrays
        self.ended: OrderedDict[str, float] = OrderedDict()   # request id -> when, oldest first

    def opened(self, msg: NewRequest) -> bool:
        """Record a new request; False for a duplicate (held or ended lately): ignore it."""
        self._forget_old()
        if msg.req_id in self.requests:
            return False
        start = detok_start(msg.req_id, msg.prompt_token_ids, msg.sampling,
                            pooled=msg.pooling is not None)
        record = self.requests[msg.req_id] = RequestRecord(start)
        self.open.update(record.tokens)
        return True

    def grew(self, msg: PromptPiece) -> None:
        """A streamed prompt's piece: its usage counts the new tokens (PromptGrew's job)."""
        record = self.requests.get(msg.req_id)
        if record is not None and record.ended_at is None:
            record.start = msgspec.structs.replace(
                record.start, num_prompt_tokens=record.start.num_prompt_tokens + len(msg.token_ids))

    def sent(self, deltas: list[TokenDelta]) -> None:
        """Deltas on their way to the detokenizer: their tokens and finals, recorded (of an
        output unknown or over already: ignored)."""
        open_outputs = self.open
        for d in deltas:
            tokens = open_outputs.get(d.seq_id)
            if tokens is not None:
                tokens.extend(d.token_ids)
                if d.finish_reason:
                    self._ended(d)

    def _ended(self, d: TokenDelta) -> None:
        del self.open[d.seq_id]
        record = self.requests[d.seq_id.req]
        record.finals[d.seq_id] = (d.finish_reason, d.error, d.pooled)
        if len(record.finals) == len(record.tokens):
            record.ended_at = self.clock()
            self.ended[d.seq_id.req] = record.ended_at

    def resync(self) -> DetokResync:
        """Every request held or ended lately, for a (re)started detokenizer."""
        self._forget_old()
        records = list(self.requests.values())
        return DetokResync([r.start for r in records], [o for r in records for o in r.outputs()])

    def _forget_old(self) -> None:
        horizon = self.clock() - RETAIN_ENDED_S
        while self.ended and next(iter(self.ended.values())) < horizon:
            req_id, _ = self.ended.popitem(last=False)
            del self.requests[req_id]      # (its outputs all ended: none is open)
