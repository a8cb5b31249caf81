"""Links between tensor-parallel ranks over ZeroMQ: the attach handshake, plan forwarding and
pings (the tensors themselves go through torch.distributed, see parallel.py).

Rank 0 binds a ROUTER (RankServer): ipc in the run directory for ranks the engine starts
itself, or `--listen tcp://HOST:PORT` for ranks attached by hand, with CURVE encryption and
only the executor key from `pagewire keys` admitted. A rank r > 0 connects a DEALER
(RankClient), says AttachHello and gets AttachWelcome (the configuration, where to join the
torch.distributed group) or AttachRefused (why). Frames decode only into the typed messages of
wire/to_executor.py.

Liveness: both sides ping each second while idle; a finished step proves every rank alive. A
rank that hears nothing from its peer for PEER_TIMEOUT raises RankFailure.
"""
from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from pagewire.wire.channels import encode, make_decoder
from pagewire.wire.engine_control import EngineControl, SleepEngine, UpdateWeights, WakeEngine
from pagewire.wire.to_executor import (AttachHello, AttachRefused, AttachWelcome, RankInbox,
                                       RankPing, RankZeroInbox, StepPlan)

CONTROLS = (SleepEngine, WakeEngine, UpdateWeights)   # forwarded like plans, in their order
log = logging.getLogger(__name__)

PING_INTERVAL = 1.0
PEER_TIMEOUT = 10.0


class RankFailure(RuntimeError):
    """A peer rank left or stopped answering: the group cannot run another step."""


class AttachFailed(RuntimeError):
    """An executor could not attach: refused (with the engine's reason) or no answer."""


# -- keys --------------------------------------------------------------------------------------

def make_keys(directory: str) -> list[str]:
    """`pagewire keys DIR`: CURVE key pairs for the engine and its executors. The engine needs
    engine.key_secret and executor.key; an executor host needs executor.key_secret and
    engine.key."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    paths = []
    for name in ("engine", "executor"):
        public, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(secret, 0o600)
        paths += [public, secret]
    return paths


def load_curve_keys(directory: str, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of `name`'s CURVE key pair in `directory` (`pagewire keys`)."""
    path = os.path.join(directory, f"{name}.key_secret" if secret else f"{name}.key")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing (make the keys with `pagewire keys DIR`)")
    return zmq.auth.load_certificate(path)


class _Admit:
    """ZAP: only the executor key connects."""

    def __init__(self, allowed: bytes):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        if key != self.allowed:
            log.warning("refused a rank connection with an unknown CURVE key")
        return key == self.allowed


# -- rank 0 ------------------------------------------------------------------------------------

class RankServer:
    """Rank 0's side: admits ranks 1..size-1, forwards plans, watches them."""

    def __init__(self, ctx: zmq.Context, address: str, size: int, check, welcome: AttachWelcome,
                 keys: str | None = None):
        """check(hello) returns a refusal reason, or None to admit."""
        self.address, self.size, self.check, self.welcome = address, size, check, welcome
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = None
        if address.startswith("tcp://"):
            self.auth = ThreadAuthenticator(ctx)
            self.auth.start()
            executor_key = load_curve_keys(keys, "executor", False)[0]
            self.auth.configure_curve_callback("*", _Admit(executor_key))
            public, secret = load_curve_keys(keys, "engine", True)
            self.sock.curve_secretkey, self.sock.curve_publickey = secret, public
            self.sock.curve_server = True
        self.sock.bind(address)
        self.decoder = make_decoder(RankZeroInbox)
        self.peers: dict[int, bytes] = {}          # rank -> ZeroMQ identity
        self.heard: dict[int, float] = {}
        self.pinged = 0.0

    def await_ranks(self, timeout: float, on_wait=None) -> None:
        """Block until every rank attached; TimeoutError naming the missing ones."""
        deadline = time.monotonic() + timeout
        while len(self.peers) < self.size - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - set(self.peers))
                raise TimeoutError(f"executor rank(s) {missing} did not attach at "
                                   f"{self.address} within {timeout:.0f} s")
            self._receive(1000)
            if on_wait is not None:
                on_wait()

    def send_plan(self, plan: StepPlan | EngineControl) -> None:
        frame = encode(plan)
        for identity in self.peers.values():
            self.sock.send_multipart([identity, frame])

    def step_done(self) -> None:
        """A step's collectives completed: every rank was alive."""
        now = time.monotonic()
        self.heard = dict.fromkeys(self.peers, now)

    def loaded(self) -> None:
        """This rank's model is loaded: the others' silence counts from now (they were loading
        theirs, pinging no one, however long that took)."""
        self.step_done()

    def poll(self) -> None:
        """Between steps: answer late hellos, ping, and fail if a rank went silent."""
        self._receive(0)
        now = time.monotonic()
        if now - self.pinged >= PING_INTERVAL:
            self.pinged = now
            for identity in self.peers.values():
                self.sock.send_multipart([identity, encode(RankPing(0))])
        for rank, heard in self.heard.items():
            if now - heard > PEER_TIMEOUT:
                raise RankFailure(f"executor rank {rank} stopped answering "
                                  f"({now - heard:.0f} s without a ping)")

    def _receive(self, timeout_ms: int) -> None:
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            identity, frame = self.sock.recv_multipart()
            try:
                msg = self.decoder.decode(frame)
            except msgspec.DecodeError as e:
                log.warning("dropped a malformed frame on the rank socket: %s", e)
                continue
            if isinstance(msg, RankPing):
                if self.peers.get(msg.rank) == identity:
                    self.heard[msg.rank] = time.monotonic()
            else:
                self._on_hello(identity, msg)

    def _on_hello(self, identity: bytes, hello: AttachHello) -> None:
        reason = self.check(hello)
        if reason is None and hello.rank in self.peers:
            reason = f"rank {hello.rank} is already attached"
        if reason is not None:
            log.warning("refused executor rank %d: %s", hello.rank, reason)
            self.sock.send_multipart([identity, encode(AttachRefused(reason))])
            return
        log.info("executor rank %d attached (%s)", hello.rank, self.address)
        self.peers[hello.rank] = identity
        self.heard[hello.rank] = time.monotonic()
        self.sock.send_multipart([identity, encode(self.welcome)])

    def close(self) -> None:
        self.sock.close()
        if self.auth is not None:
            self.auth.stop()


# -- ranks 1.. ---------------------------------------------------------------------------------

class RankClient:
    """A rank r > 0's side: attaches, then receives plans from rank 0."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, keys: str | None = None):
        self.address, self.rank = address, rank
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://"):
            if not keys:
                raise AttachFailed("attaching over TCP needs --curve-keys DIR (with "
                                   "executor.key_secret and engine.key from `pagewire keys`)")
            public, secret = load_curve_keys(keys, "executor", True)
            self.sock.curve_secretkey, self.sock.curve_publickey = secret, public
            self.sock.curve_serverkey = load_curve_keys(keys, "engine", False)[0]
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self.sock.connect(address)
        self.decoder = make_decoder(RankInbox)
        self.heard = self.pinged = time.monotonic()

    def attach(self, hello: AttachHello, timeout: float) -> AttachWelcome:
        """Say hello; the welcome, or AttachFailed with the reason. A DEALER's send blocks
        while it has no pipe (a refused handshake drops it), so hello waits for POLLOUT."""
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN | zmq.POLLOUT)
        poller.register(self.monitor, zmq.POLLIN)
        while time.monotonic() < deadline:
            ready = dict(poller.poll(200))
            if self.monitor in ready:
                recv_monitor_message(self.monitor)
                raise AttachFailed(f"{self.address} refused this executor's CURVE key (is "
                                   "executor.key_secret from the engine's `pagewire keys`?)")
            if ready.get(self.sock, 0) & zmq.POLLOUT and self._send(hello):
                poller.modify(self.sock, zmq.POLLIN)
            elif ready.get(self.sock, 0) & zmq.POLLIN:
                msg = self.decoder.decode(self.sock.recv())
                if isinstance(msg, AttachRefused):
                    raise AttachFailed(f"{self.address} refused rank {self.rank}: {msg.reason}")
                if isinstance(msg, AttachWelcome):
                    self.heard = time.monotonic()
                    return msg
        raise AttachFailed(f"no answer from {self.address} within {timeout:.0f} s (is the "
                           "engine listening there, with the same keys?)")

    def recv(self, timeout_ms: int) -> StepPlan | EngineControl | None:
        """The next plan (or sleep-mode control, in plan order), or None after timeout_ms; pings rank 0 meanwhile. RankFailure when
        rank 0 has been silent for PEER_TIMEOUT."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            now = time.monotonic()
            if now - self.pinged >= PING_INTERVAL:
                self.pinged = now
                self._send(RankPing(self.rank))
            if now - self.heard > PEER_TIMEOUT:
                raise RankFailure(f"rank 0 at {self.address} stopped answering")
            wait = min(deadline, self.pinged + PING_INTERVAL) - now
            if self.sock.poll(max(0, int(wait * 1000))):
                msg = self.decoder.decode(self.sock.recv())
                self.heard = time.monotonic()
                if isinstance(msg, (StepPlan, *CONTROLS)):
                    return msg
            elif time.monotonic() >= deadline:
                return None

    def _send(self, msg) -> bool:
        """Without blocking: False where rank 0's pipe is gone (PEER_TIMEOUT then tells)."""
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def step_done(self) -> None:
        self.heard = time.monotonic()

    def loaded(self) -> None:
        """This rank's model is loaded: rank 0's silence counts from now (it was loading its
        own, pinging no one, however long that took)."""
        self.heard = time.monotonic()

    def close(self) -> None:
        # linger 0 on both: a handshake refused under load can leave monitor events queued,
        # and a socket that lingers on them keeps the context's term() waiting for ever
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
