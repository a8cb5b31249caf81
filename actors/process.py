"""What every actor process does at start, whatever its role.

    python -m pagewire.process ROLE CONFIG_JSON_PATH [INDEX | spare]

The supervisor starts each actor so: no fork of a process holding threads or sockets, no
pickled arguments. The actor names itself ("pagewire: executor 0"), dies with its parent,
leaves SIGINT to the supervisor (a terminal's Ctrl-C reaches the whole group), builds its
sockets, and reports Ready, or Fatal with the reason, to the supervisor's inbox.

A warm spare (INDEX "spare", --warm-spares: spares.py) does the slow part ahead: it imports
its role's module and runs its prepare(config) (a tokenizer loads transformers and the
model's tokenizer), then waits for the supervisor to write the index it replaces on its
stdin, and only then starts as that actor: run(env, prepared). End of input: it exits.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import zmq

from pagewire.wire.channels import PullChannel, PushChannel, ipc_address
from pagewire.wire.trace import FORMAT_VERSION, TraceHeader, TraceWriter
from pagewire.wire.to_supervisor import Fatal, Heartbeat, Ready

from .config import EngineConfig

# role -> module with run(env). Actors never import each other: only this table names them.
ROLES = {
    "executor": "pagewire.executor.actor",
    "scheduler": "pagewire.scheduler.actor",
    "tokenizer": "pagewire.tokenizer",
    "detokenizer": "pagewire.detokenizer",
    "gateway": "pagewire.gateway.actor",
}

_PR_SET_PDEATHSIG = 1
STOP_SIGNAL = signal.SIGUSR1   # the supervisor's "exit now"
FATAL_EXIT_CODE = 1            # an actor that exits so has sent Fatal first
HEARTBEAT_INTERVAL = 1.0     # seconds; an actor silent for HEARTBEAT_TIMEOUT counts as hung
HEARTBEAT_TIMEOUT = float(os.environ.get("PAGEWIRE_HEARTBEAT_TIMEOUT", "10"))


@dataclass
class ActorEnv:
    """Handed to an actor's run(): its identity, the config and the means to reach others."""
    role: str
    index: int
    config: EngineConfig
    ctx: zmq.Context
    supervisor: PushChannel
    tracer: TraceWriter | None = None
    _last_heartbeat: float = 0.0

    @property
    def name(self) -> str:
        return self.role if self.role in ("scheduler", "detokenizer", "gateway") \
            else f"{self.role} {self.index}"

    def address(self, inbox: str) -> str:
        """ipc address of an inbox: "scheduler", "executor-0", "tokenizer-1", ..."""
        return ipc_address(self.config.run_dir, inbox)

    def push(self, inboxes: str | list[str]) -> PushChannel:
        """A channel to another actor's inbox (round-robin over several), traced under the
        first inbox's name when tracing is on."""
        names = [inboxes] if isinstance(inboxes, str) else inboxes
        return PushChannel(self.ctx, [self.address(n) for n in names], tracer=self.tracer,
                           name=names[0].split("-")[0] if len(names) > 1 else names[0])

    def pull(self, inbox: str, inbox_type) -> PullChannel:
        """This actor's inbox, traced when tracing is on."""
        return PullChannel(self.ctx, self.address(inbox), inbox_type, tracer=self.tracer,
                           name=inbox)

    def messages(self, inbox: PullChannel):
        """Each message of inbox as it comes, heartbeating at least once a second meanwhile."""
        while True:
            msg = inbox.recv(timeout_ms=1000)
            self.heartbeat()
            if msg is not None:
                yield msg

    def ready(self, backend: str = "") -> None:
        # What the actor loaded lives as long as it does: frozen, the cyclic collector stops
        # rescanning it (an executor's decode loop spent ~1.6 % of its samples there).
        gc.freeze()
        self.supervisor.send(Ready(self.name, os.getpid(), backend))

    def heartbeat(self, step_running_for: float = 0.0) -> None:
        """Tell the supervisor this actor's loop is alive; call as often as convenient, it
        sends at most one message per HEARTBEAT_INTERVAL."""
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_INTERVAL:
            self._last_heartbeat = now
            self.supervisor.send(Heartbeat(self.name, step_running_for))
            if self.tracer is not None:
                self.tracer.flush()      # a live trace is readable within a second


def open_tracer(config: EngineConfig, actor: str) -> TraceWriter | None:
    """This actor's trace writer when the engine records (--trace DIR)."""
    if not config.observability.trace_dir:
        return None
    info, tracing = config.model.model_info, config.observability
    header = TraceHeader(version=FORMAT_VERSION, actor=actor, pid=os.getpid(), segment=0,
                         config_digest=tracing.config_digest or config.digest(),
                         model_id=f"{info.name}@{info.digest}",
                         config_json=config.public().to_json().decode(), started=time.time(),
                         redacted=tracing.trace_redact)
    return TraceWriter(tracing.trace_dir, header, tracing.trace_segment_bytes,
                       tracing.trace_max_segments)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the supervisor dies, even by SIGKILL."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):   # not Linux: the supervisor's shutdown still ends us
        return
    if os.getppid() != parent:          # the parent died before prctl took effect
        os._exit(1)


def setup_logging(name: str) -> None:
    logging.basicConfig(level=os.environ.get("PAGEWIRE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", stream=sys.stderr)


def _read_config(path: str) -> EngineConfig:
    with open(path, "rb") as f:
        return EngineConfig.from_json(f.read())


def _wait_as_spare(role: str, config: EngineConfig):
    """A warm spare: prepare ahead, then wait for the index to serve as. Returns (index,
    what prepare made); exits at the end of input (the supervisor let it go)."""
    import setproctitle
    setproctitle.setproctitle(f"pagewire: spare {role}")
    prepared = importlib.import_module(ROLES[role]).prepare(config)
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)
    return int(line), prepared


def main(argv: list[str]) -> None:
    atexit.register(end_quietly)
    role, config_path = argv[0], argv[1]
    spare = len(argv) > 2 and argv[2] == "spare"
    config = _read_config(config_path)
    die_with_parent()
    # Stopping is the supervisor's call: SIGINT (a terminal's Ctrl-C reaches the group) and
    # SIGTERM (systemd's KillMode=control-group signals every process) are left to it, so the
    # gateway can drain first; it stops the others with STOP_SIGNAL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, lambda *_: sys.exit(0))
    if role != "executor" and config.actor_nice:
        os.nice(config.actor_nice)
    prepared, index = None, int(argv[2]) if len(argv) > 2 and not spare else 0
    if spare:
        index, prepared = _wait_as_spare(role, config)
        config = _read_config(config_path)      # as the supervisor wrote it last
    ctx = zmq.Context()
    env = ActorEnv(role, index, config, ctx,
                   PushChannel(ctx, ipc_address(config.run_dir, "supervisor")))
    env.tracer = open_tracer(config, env.name)
    import setproctitle
    setproctitle.setproctitle(f"pagewire: {env.name}")
    setup_logging(env.name)
    try:
        module = importlib.import_module(ROLES[role])
        module.run(env, prepared) if spare else module.run(env)
    except SystemExit:       # STOP_SIGNAL
        pass
    except BaseException as e:
        if env.tracer is not None:
            env.tracer.close()
        logging.getLogger(env.name).error("fatal: %s", traceback.format_exc())
        send_last_words(config, Fatal(env.name, f"{type(e).__name__}: {e}", os.getpid()))
        logging.shutdown()
        # Not ctx.term(): it waits for every socket to close, and the failure may have left
        # some open (or a thread using them, like a CURVE authenticator).
        os._exit(FATAL_EXIT_CODE)
    if env.tracer is not None:
        env.tracer.close()


def end_quietly() -> None:
    """The last exit handler of a stopped actor (registered first, so the ones registered
    after it, like the disk KV tier's flush, run before): logging flushed, then the process
    ends without the interpreter's teardown, where Triton's bindings (nanobind) print a page of
    "leaked instance" warnings into the log on every stop."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def send_last_words(config: EngineConfig, fatal: Fatal) -> None:
    """Deliver Fatal before the process exits. A send only queues the frame for zmq's IO
    thread, and os._exit does not wait for it; a private context's term() does (up to the
    linger), without waiting on the sockets the failure may have left open elsewhere."""
    ctx = zmq.Context()
    channel = PushChannel(ctx, ipc_address(config.run_dir, "supervisor"))
    channel.send(fatal)
    channel.sock.setsockopt(zmq.LINGER, 2000)
    channel.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])
