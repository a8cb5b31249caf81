"""The kv-aware router's subscription to one replica's KV events (wire/kv_events.py): a SUB
socket on the replica's endpoint and, when the replica has one, a DEALER on its replay
endpoint. Each batch goes to the replica's ReplicaCache in sequence order.

- A gap in the sequence numbers (the PUB socket dropped batches for this subscriber) is
  filled from the replay endpoint; without one, or when the replica no longer buffers them,
  the router goes on with what it has and counts the gap (a missed removal leaves a stale
  block; a missed store leaves its children unlinked until they are stored again).
- The first batch heard asks for a replay from 0: a router started after its replicas learns
  what they cached since they started (as far back as their buffer_steps).
- A sequence number lower than expected is a restarted publisher: its replica's pool starts
  empty (its first batch is AllBlocksCleared), and so does the router's view of it.
"""
from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from pagewire.wire.kv_events import END_SEQ, KVEventBatch, seq_bytes, seq_of

from .router_kv_index import ReplicaCache

log = logging.getLogger("router")
REPLAY_TIMEOUT = 2.0     # seconds to wait for each replayed batch


class ReplicaEvents:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str | None,
                 topic: str, cache: ReplicaCache):
        self.cache = cache
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = ctx.socket(zmq.DEALER)
            self.replay.linger = 0
            self.replay.connect(replay_endpoint)
        self.next_seq: int | None = None
        self.batches = self.gaps = self.bad = 0

    async def run(self) -> None:
        while True:
            _topic, number, payload = await self.sub.recv_multipart()
            seq = seq_of(number)
            if self.next_seq is None or seq > self.next_seq:
                await self._catch_up(0 if self.next_seq is None else self.next_seq, seq)
            elif seq < self.next_seq:
                log.warning("KV events restarted at %d (expected %d): forgetting the replica's "
                            "blocks", seq, self.next_seq)
                self.cache.clear()
            if self.next_seq is None or seq >= self.next_seq:
                self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = self.decoder.decode(payload)
        except msgspec.ValidationError as e:
            self.bad += 1
            log.warning("undecodable KV event batch %d: %s", seq, e)
        else:
            self.cache.apply(batch)
        self.batches += 1
        self.next_seq = seq + 1

    async def _catch_up(self, first: int, seq: int) -> None:
        """Apply batches first..seq-1 from the replay endpoint, as far as it has them."""
        if first == seq:
            return
        if self.replay is not None:
            await self.replay.send_multipart([b"", seq_bytes(first)])
            while True:
                if not await self.replay.poll(REPLAY_TIMEOUT * 1000):
                    log.warning("KV event replay timed out")
                    break
                _, number, payload = await self.replay.recv_multipart()
                if number == END_SEQ:
                    break
                got = seq_of(number)
                if got < seq and (self.next_seq is None or got >= self.next_seq):
                    self._apply(got, payload)
        if self.next_seq != seq and not (first == 0 and self.next_seq is None):
            self.gaps += 1
            log.warning("KV events %d..%d missed", self.next_seq or first, seq - 1)

    def close(self) -> None:
        self.sub.close(0)
        if self.replay is not None:
            self.replay.close(0)
