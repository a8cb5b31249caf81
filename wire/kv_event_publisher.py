"""The scheduler's KV event publisher (layout: kv_events.py): a PUB socket for the live stream
and a ROUTER socket answering replay requests from a buffer of recent batches.

The step loop's cost is publish(): encode one batch (a step's events) and hand the bytes to
the publisher's thread over an inproc pipe; numbering, sending, buffering and replays happen
on that thread, which sleeps in a poll between them. A PUB socket never blocks: past `hwm`
queued messages a slow subscriber's copies are dropped, and it asks for a replay.

Endpoints as vLLM reads them: the PUB endpoint is bound when it has a wildcard (`*`, `::`) or
is ipc:// or inproc://, else connected (to a collector that binds); the replay endpoint is
always bound. Imports no torch.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import deque

import msgspec
import zmq

from .kv_events import END_SEQ, KVEventBatch, seq_bytes, seq_of

log = logging.getLogger(__name__)
_STOP = b""


def publisher_for(section) -> "KvEventPublisher | None":
    """The publisher a --kv-events-config section (config_sections.KVEventsConfig) asks for;
    None when it publishes nothing."""
    if section is None or not section.publishes:
        return None
    log.info("publishing KV cache events on %s (replay: %s, topic %r)", section.endpoint,
             section.replay_endpoint, section.topic)
    return KvEventPublisher(section.endpoint, section.replay_endpoint, section.topic,
                            section.buffer_steps, section.hwm)


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000,
                 ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.numbers = itertools.count()
        self.encoder = msgspec.msgpack.Encoder()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        self.pub.linger = 0
        (self.pub.bind if binds(endpoint) else self.pub.connect)(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.linger = 0
            self.replay.bind(replay_endpoint)
        pipe = f"inproc://kv-events-{id(self)}"
        self.inlet = self.ctx.socket(zmq.PAIR)       # the publisher thread's end
        self.inlet.bind(pipe)
        self.outlet = self.ctx.socket(zmq.PAIR)      # the step loop's end
        self.outlet.sndhwm = buffer_steps
        self.outlet.connect(pipe)
        self.dropped = 0           # batches the thread had no room for (it never falls behind)
        self.thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self.thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Called by the step loop: one batch, one send; never blocks the loop."""
        try:
            self.outlet.send(self.encoder.encode(batch), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                log.error("the KV event publisher's thread is not taking batches: dropping")

    def close(self) -> None:
        try:
            self.outlet.send(_STOP, zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.thread.join(5)
        self.outlet.close(0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inlet, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self.inlet in ready:
                    payload = self.inlet.recv()
                    if payload == _STOP:
                        return
                    self._send(payload)
                if self.replay is not None and self.replay in ready:
                    try:
                        self._answer_replay()
                    except zmq.ZMQError as e:       # a client gone mid-answer: serve on
                        log.warning("KV event replay failed: %s", e)
        finally:
            for sock in (self.inlet, self.pub, self.replay):
                if sock is not None:
                    sock.close(0)

    def _send(self, payload: bytes) -> None:
        seq = next(self.numbers)
        self.pub.send_multipart((self.topic, seq_bytes(seq), payload))
        self.buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        """A request is [identity, b"", start seq] (a REQ client's envelope): the buffered
        batches numbered from start on, then the end marker."""
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = seq_of(start)
        for seq, payload in self.buffer:
            if seq >= first:
                self.replay.send_multipart((client, b"", seq_bytes(seq), payload))
        self.replay.send_multipart((client, b"", END_SEQ, b""))
