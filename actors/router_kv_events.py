"""The kv-aware router's subscription to one replica's KV events (wire/kv_events.py): a SUB
socket on the replica's endpoint and, when the replica has one, a DEALER on its replay
endpoint. Each batch goes to the replica's ReplicaCache in sequence order.

- A gap in the sequence numbers (the PUB socket dropped batches for this subscriber) is
  filled from the replay endpoint; without one, or when the replica no longer buffers them,
  the router goes on with what it has and counts the gap (a missed removal leaves a stale
  block; a missed store leaves its children unlinked until they are stored again).
- The first batch heard asks for a replay from 0: a router started after its replicas learns
  what they cached since they started (as far back as their buffer_steps).
- A restarted scheduler numbers its batches from 0 again and starts with an empty pool (its
  first batch is AllBlocksCleared). After the SUB socket lost its connection (a socket
  monitor says so), or when a number comes lower than expected, the router asks for a replay
  from 0: when the replica still has its batch 0, its view is rebuilt from it (right whether
  or not the replica restarted); else a lower number means a restart and the view starts
  empty. Without a replay endpoint, a restart is seen only by a lower number.
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
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.reconnected = False
        self.next_seq: int | None = None
        self.batches = self.gaps = self.bad = 0

    async def run(self) -> None:
        while True:
            _topic, number, payload = await self.sub.recv_multipart()
            seq = seq_of(number)
            while await self.monitor.poll(0):          # the SUB socket lost its publisher
                await self.monitor.recv_multipart()
                self.reconnected = True
            if self.reconnected or (self.next_seq is not None and seq < self.next_seq):
                self.reconnected = False
                await self._resync(seq)
            elif self.next_seq is None or seq > self.next_seq:
                await self._catch_up(self.next_seq or 0, seq)
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

    async def _replayed(self, first: int, seq: int) -> list[tuple[int, bytes]]:
        """The replica's buffered batches numbered first..seq-1 (none without a replay
        endpoint)."""
        if self.replay is None or first >= seq:
            return []
        await self.replay.send_multipart([b"", seq_bytes(first)])
        got = []
        while await self.replay.poll(REPLAY_TIMEOUT * 1000):
            _, number, payload = await self.replay.recv_multipart()
            if number == END_SEQ:
                return got
            if first <= seq_of(number) < seq:
                got.append((seq_of(number), payload))
        log.warning("KV event replay timed out")
        return got

    async def _catch_up(self, first: int, seq: int) -> None:
        """Apply batches first..seq-1 from the replay endpoint, as far as it has them."""
        for got, payload in await self._replayed(first, seq):
            if self.next_seq is None or got >= self.next_seq:
                self._apply(got, payload)
        if self.next_seq is not None and self.next_seq != seq:
            self.gaps += 1
            log.warning("KV events %d..%d missed", self.next_seq, seq - 1)

    async def _resync(self, seq: int) -> None:
        """The publisher may have restarted (see the module's docstring)."""
        batches = await self._replayed(0, seq)
        went_back = self.next_seq is not None and seq < self.next_seq
        if (batches and batches[0][0] == 0) or went_back:
            if went_back:
                log.warning("KV events restarted at %d (expected %d): the replica's pool "
                            "starts over", seq, self.next_seq)
            self.cache.clear()
            self.next_seq = None
        for got, payload in batches:
            if self.next_seq is None or got >= self.next_seq:
                self._apply(got, payload)
        if self.next_seq is not None and self.next_seq != seq:
            self.gaps += 1
            log.warning("KV events %d..%d missed", self.next_seq, seq - 1)

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(0)
        self.sub.close(0)
        if self.replay is not None:
            self.replay.close(0)
