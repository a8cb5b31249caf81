"""Typed ZeroMQ channels.

Every actor binds one PULL inbox; whoever talks to it connects a PUSH. A PullChannel decodes with
one msgspec Decoder over the union of message types its actor accepts, so an unknown or malformed
frame raises msgspec.DecodeError / ValidationError instead of becoming an object; there is no
pickle anywhere. Sockets live in a private 0700 run directory as ipc:// endpoints.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .trace import TraceWriter

_encoder = msgspec.msgpack.Encoder()

# What an engine core returns for a message it handled: (destination actor, message) pairs,
# in the order they must be sent. The actor loop, the replayer and the offline LLM route them.
Sends = list[tuple[str, msgspec.Struct]]


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def make_decoder(inbox_type: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(inbox_type)


def make_run_dir(parent: str | None = None) -> str:
    """A fresh private directory for this engine's sockets (mode 0700, removed by the
    supervisor at exit). `parent` is e.g. systemd's RUNTIME_DIRECTORY."""
    path = tempfile.mkdtemp(prefix="pagewire-", dir=parent)
    os.chmod(path, 0o700)
    return path


def ipc_address(run_dir: str, name: str) -> str:
    """The inbox address of actor `name` ("scheduler", "executor-0", ...)."""
    path = f"{os.path.join(run_dir, name)}.sock"
    if len(path.encode()) > 107:  # sun_path holds 108 bytes with the NUL
        raise ValueError(f"run directory path too long for an ipc socket: {path}")
    return f"ipc://{path}"


def _configure(sock: zmq.Socket) -> None:
    # No high-water mark: a full queue would block a sender, and two actors that push to each
    # other (scheduler <-> detokenizer) could then deadlock. Queues are bounded upstream by the
    # request limits instead.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)


class PushChannel:
    """Sends typed messages to one actor's inbox (or round-robin to several, if connected to
    more than one address). With a tracer, each frame sent is also recorded under `name`."""

    def __init__(self, ctx: zmq.Context, addresses: str | list[str], *, bind: bool = False,
                 tracer: TraceWriter | None = None, name: str = ""):
        self.sock = ctx.socket(zmq.PUSH)
        _configure(self.sock)
        for address in [addresses] if isinstance(addresses, str) else addresses:
            self.sock.bind(address) if bind else self.sock.connect(address)
        self.tracer, self.name = tracer, name

    def send(self, msg: msgspec.Struct) -> None:
        frame = encode(msg)
        if self.tracer is not None:     # before the send: a receiver's record never precedes it
            self.tracer.record_message("out", self.name, msg, frame)
        self.sock.send(frame, copy=False)

    def close(self) -> None:
        self.sock.close()


class _Inbox:
    """What both inbox flavours share: a bound (or connected) PULL socket, the typed decoder
    and the trace copy of each frame received."""

    def __init__(self, sock: zmq.Socket, address: str, inbox_type: Any, bind: bool,
                 tracer: TraceWriter | None, name: str):
        self.sock = sock
        _configure(self.sock)
        self.sock.bind(address) if bind else self.sock.connect(address)
        self.decoder = make_decoder(inbox_type)
        self.tracer, self.name = tracer, name

    def _decode(self, frame) -> Any:
        msg = self.decoder.decode(frame)
        if self.tracer is not None:
            self.tracer.record_message("in", self.name, msg, frame)
        return msg

    def close(self) -> None:
        self.sock.close()


class PullChannel(_Inbox):
    """An actor's inbox. recv() returns one decoded message, or None on timeout. With a
    tracer, each frame received is also recorded under `name`."""

    def __init__(self, ctx: zmq.Context, address: str, inbox_type: Any, *, bind: bool = True,
                 tracer: TraceWriter | None = None, name: str = ""):
        super().__init__(ctx.socket(zmq.PULL), address, inbox_type, bind, tracer, name)

    def recv(self, timeout_ms: int | None = None) -> Any:
        """Block up to timeout_ms (None: forever; 0: poll) for the next message."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._decode(self.sock.recv(copy=False).buffer)


class AsyncPullChannel(_Inbox):
    """The asyncio flavour of PullChannel, for the gateway's event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, inbox_type: Any, *,
                 tracer: TraceWriter | None = None, name: str = ""):
        super().__init__(ctx.socket(zmq.PULL), address, inbox_type, True, tracer, name)

    async def recv(self) -> Any:
        return self._decode((await self.sock.recv(copy=False)).buffer)
