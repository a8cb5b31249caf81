"""The supervisor: starts every actor, watches them, restarts them, and stops them all.

Every actor starts at once: the engine core (executors, scheduler, detokenizer), the
tokenizers and the gateway, which builds its routes meanwhile but opens its HTTP port only when
told EngineReady, once every other actor has said Ready, so nothing listens for HTTP before the
engine can serve. Then READY=1 goes to systemd (STATUS= lines while loading).

While serving it reads every actor's heartbeat and pings systemd's watchdog (WATCHDOG=1 at half
of $WATCHDOG_USEC) only while all of them are fresh and no step has stalled: a hung executor
stops the pings and systemd restarts the service.

When an actor dies:
- a tokenizer or the detokenizer is restarted and no request is lost: the gateway hears
  "lost" (EngineEvent) and resends what a dead tokenizer held to a live one (requests keep
  arriving and are served meanwhile); a new detokenizer asks the scheduler for the state of
  every request (DetokResync: its start and all its tokens) and rebuilds their text, of
  which the gateway forwards only what its clients have not had; "back" once it serves;
- the gateway is restarted; the scheduler aborts every request (their clients are gone);
- the scheduler or an executor: the gateway fails every request in flight and answers 503
  while the core (executors, scheduler, detokenizer) restarts, then serves again.
With --warm-spares such a restart promotes a loaded spare process (spares.py) instead of
starting one cold. More than `restart_budget` restarts within `restart_window` seconds:
everything stops and the supervisor exits 1, for systemd's Restart=on-failure to take over.

On SIGINT/SIGTERM: STOPPING=1, the gateway drains (in-flight requests finish, new ones get
503), then the other actors stop; the run directory with its sockets is removed.
"""
from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import zmq

from pagewire.wire.channels import PullChannel, PushChannel, ipc_address, make_run_dir
from pagewire.wire.to_gateway import EngineEvent, EngineReady
from pagewire.wire.to_scheduler import AbortAll
from pagewire.wire.to_supervisor import Fatal, Heartbeat, Ready, SupervisorInbox
from pagewire.wire.trace import set_recording

from .config import ACTOR_SECTIONS, EngineConfig
from .config_sections import EXTERNAL
from .process import FATAL_EXIT_CODE, HEARTBEAT_TIMEOUT, STOP_SIGNAL
from .sd_notify import notify, watchdog_period
from .spares import WarmSpares

log = logging.getLogger("supervisor")
START_TIMEOUT = 300.0
STOP_TIMEOUT = 10.0
STEP_STALLED_AFTER = 60.0       # a step running this long counts as a hung executor
FATAL_WAIT = 2.0                # how long a dead actor's Fatal may still be in flight
ENGINE_READY_EVERY = 1.0        # EngineReady again while the gateway has not said Ready
CORE = ("executor", "scheduler", "detokenizer")


class ActorFailed(RuntimeError):
    """The server cannot go on: it stops and exits 1."""


class RestartFailed(RuntimeError):
    """An actor failed while a restart waited for Ready: one more restart, within the budget."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name}: {why}")
        self.name, self.why = name, why


def actor_name(role: str, index: int) -> str:
    return role if role in ("scheduler", "detokenizer", "gateway") else f"{role} {index}"


class Supervisor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.children: dict[str, subprocess.Popen] = {}
        self.ready: set[str] = set()
        self.last_beat: dict[str, float] = {}
        self.step_running_for = 0.0
        self.restarts: collections.deque[float] = collections.deque()
        self.fatal: dict[str, str] = {}            # actor -> what it said when it failed
        self.stop_requested = False
        self.ctx = zmq.Context()
        self.inbox: PullChannel | None = None
        self.watchdog_period = watchdog_period()
        self.next_ping = 0.0
        self.engine_ready_sent = (0, 0.0)          # (gateway pid, when) EngineReady went last
        # starting -> serving <-> recovering. Starting: any failure stops the server (exit 1).
        # Recovering: a failure is one more restart, charged to the budget. The watchdog is
        # pinged from the first READY=1 on.
        self.state = "starting"
        self.spares = WarmSpares(lambda role: self._command(role, "spare")) \
            if config.server.warm_spares else None

    def run(self) -> int:
        """Serve until a signal, or until actors die past the restart budget. Returns the
        process exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.start()
            log.info("serving %s on http://%s:%d", self.config.model.served_model_name,
                     self.config.server.host, self.config.server.port)
            notify(f"READY=1\nSTATUS=serving {self.config.model.served_model_name}")
            self.state = "serving"
            self.watch()
            return 0
        except (ActorFailed, ValueError, OSError) as e:
            log.error("%s", e)
            return 1
        finally:
            notify("STOPPING=1")
            self.stop()

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> None:
        run_dir = make_run_dir(os.environ.get("RUNTIME_DIRECTORY"))
        self.config = self.config.replace(run_dir=run_dir)
        self._write_configs()
        self.inbox = PullChannel(self.ctx, ipc_address(run_dir, "supervisor"), SupervisorInbox)
        self.gateway_channel = PushChannel(self.ctx, ipc_address(run_dir, "gateway"))
        self.scheduler_channel = PushChannel(self.ctx, ipc_address(run_dir, "scheduler"))
        if self.config.observability.trace_dir:      # recording is on from the start (--trace)
            set_recording(self.config.observability.trace_dir, True)
        notify(f"STATUS=loading {self.config.model.served_model_name}")
        tokenizers = [("tokenizer", i) for i in range(self.config.server.num_tokenizers)]
        for role, index in self._core() + tokenizers + [("gateway", 0)]:
            self._spawn(role, index)
        self._await_ready()

    def _core(self) -> list[tuple[str, int]]:
        """The engine core, restarted together. With --executors external only rank 0 is
        ours: the other ranks attach to it (and again after a restart)."""
        parallel = self.config.parallel
        ranks = 1 if parallel.executors == EXTERNAL else parallel.tensor_parallel_size
        return [("executor", r) for r in range(ranks)] + [("scheduler", 0), ("detokenizer", 0)]

    def _config_path(self, role: str) -> str:
        return os.path.join(self.config.run_dir, f"config-{role}.json")

    def _write_configs(self) -> None:
        """Each role's configuration file: the sections its actors read (config.for_actor),
        private to this user (the gateway's holds the API keys)."""
        for role in ACTOR_SECTIONS:
            fd = os.open(self._config_path(role), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as f:
                f.write(self.config.for_actor(role).to_json())

    def _command(self, role: str, index: str) -> list[str]:
        return [sys.executable, "-m", "pagewire.process", role, self._config_path(role), index]

    def _spawn(self, role: str, index: int) -> None:
        name = actor_name(role, index)
        spare = self.spares.take(role, index) if self.spares and self.state != "starting" else None
        self.children[name] = spare or subprocess.Popen(self._command(role, str(index)))
        self.ready.discard(name)
        self.last_beat[name] = time.monotonic()

    def _await_ready(self) -> None:
        """Wait until every actor started so far has said Ready."""
        deadline = time.monotonic() + START_TIMEOUT
        parallel = self.config.parallel
        if parallel.executors == EXTERNAL and "executor 0" not in self.ready:
            deadline += parallel.attach_timeout   # rank 0 waits for the attached ranks
            notify(f"STATUS=waiting for executor ranks 1..{parallel.tensor_parallel_size - 1}"
                   f" to attach at {parallel.listen}")
        while len(self.ready) < len(self.children):
            if self.stop_requested:
                raise ActorFailed("stopped while starting")
            if time.monotonic() > deadline:
                raise ActorFailed(f"actors not ready after {START_TIMEOUT:.0f}s: "
                                  f"{sorted(set(self.children) - self.ready)}")
            self._handle(self.inbox.recv(200))
            self._open_gateway()
            if self.state != "starting":     # a core restart reloads the model: stay alive
                self._ping_watchdog()
            for name in [n for n in self.fatal if n in self.children and n not in self.ready]:
                raise self._start_failure(name, self.fatal.pop(name))
            for name, proc in self.children.items():
                if proc.poll() is not None:
                    raise self._start_failure(name, f"exited with code {proc.returncode}")

    def _open_gateway(self) -> None:
        """A gateway not yet Ready opens its HTTP port on EngineReady: send it once every other
        actor is Ready (and again each ENGINE_READY_EVERY, in case a frame sent while it was
        starting was lost)."""
        gateway = self.children.get("gateway")
        if gateway is None or "gateway" in self.ready or \
                any(n not in self.ready for n in self.children if n != "gateway"):
            return
        pid, sent = self.engine_ready_sent
        if pid == gateway.pid and time.monotonic() - sent < ENGINE_READY_EVERY:
            return
        if pid != gateway.pid:
            notify("STATUS=starting the gateway")
            self._write_configs()                       # with the backend rank 0 reported
        self.gateway_channel.send(EngineReady(self.config.device.backend))
        self.engine_ready_sent = (gateway.pid, time.monotonic())

    def _start_failure(self, name: str, why: str) -> Exception:
        if self.state == "recovering":
            return RestartFailed(name, why)
        return ActorFailed(f"{name} failed to start: {why}")

    def _handle(self, msg) -> None:
        if isinstance(msg, Ready):
            self.ready.add(msg.actor)
            self.last_beat[msg.actor] = time.monotonic()
            log.info("%s ready (pid %d)%s", msg.actor, msg.pid,
                     f", backend {msg.backend}" if msg.backend else "")
            if msg.backend and msg.actor == "executor 0":
                self.config = self.config.replace(backend=msg.backend)
        elif isinstance(msg, Heartbeat):
            self.last_beat[msg.actor] = time.monotonic()
            if msg.actor == "scheduler":
                self.step_running_for = msg.step_running_for
        elif isinstance(msg, Fatal):
            log.error("%s failed: %s", msg.actor, msg.message)
            child = self.children.get(msg.actor)
            if child is not None and msg.pid in (0, child.pid):   # not a replaced instance's
                self.fatal[msg.actor] = msg.message

    # -- watching ------------------------------------------------------------------------------

    def watch(self) -> None:
        while not self.stop_requested:
            self._handle(self.inbox.recv(200))
            dead = next(((n, p) for n, p in self.children.items() if p.poll() is not None), None)
            if dead is not None:       # one at a time: a recovery replaces other children too
                self.recover(dead[0], dead[1].returncode)
            elif self.spares:
                self.spares.refill()
            self._ping_watchdog()

    def _ping_watchdog(self) -> None:
        """WATCHDOG=1 every half $WATCHDOG_USEC, only while healthy. While actors restart the
        silent ones are the new ones, which _spawn counted as fresh."""
        if self.watchdog_period and time.monotonic() >= self.next_ping:
            if self.healthy():
                notify("WATCHDOG=1")
            self.next_ping = time.monotonic() + self.watchdog_period

    def healthy(self) -> bool:
        """Every actor's heartbeat is fresh and no step has stalled."""
        now = time.monotonic()
        stale = [n for n, t in self.last_beat.items() if now - t > HEARTBEAT_TIMEOUT]
        if stale or self.step_running_for > STEP_STALLED_AFTER:
            log.warning("not pinging the watchdog: silent %s, step running for %.0fs",
                        stale, self.step_running_for)
            return False
        return True

    def recover(self, name: str, code: int) -> None:
        """Restart a dead actor (and what depends on it), each restart charged to the budget;
        an actor that fails while a restart waits for Ready is the next one to restart."""
        self.state = "recovering"
        why = self._last_words(name, FATAL_WAIT if code == FATAL_EXIT_CODE else 0.05)
        reason = f"{name} exited with code {code}" + (f": {why}" if why else "")
        while True:
            self._charge_restart(reason)
            try:
                self._restart(name, reason)
                break
            except RestartFailed as e:
                name, reason = e.name, f"{e.name} failed while restarting: {e.why}"
        self.state = "serving"

    def _charge_restart(self, reason: str) -> None:
        now, server = time.monotonic(), self.config.server
        self.restarts.append(now)
        while self.restarts and now - self.restarts[0] > server.restart_window:
            self.restarts.popleft()
        if len(self.restarts) > server.restart_budget:
            raise ActorFailed(f"{reason}; over the restart budget "
                              f"({server.restart_budget} in {server.restart_window:.0f}s)")
        log.error("%s; restarting", reason)

    def _restart(self, name: str, reason: str) -> None:
        role = name.split()[0]
        if role in ("scheduler", "executor"):
            self._restart_core(reason)
        elif role == "gateway":
            self.scheduler_channel.send(AbortAll(f"{name} died"))
            self._respawn(name)
        else:
            # A stateless actor: nothing fails. The gateway resends what a tokenizer held and
            # routes around it; a new detokenizer is rebuilt from the scheduler's record.
            self.gateway_channel.send(EngineEvent("lost", f"{name} died", name))
            self._respawn(name)
            self.gateway_channel.send(EngineEvent("back", f"{name} restarted", name))

    def _last_words(self, name: str, wait: float) -> str | None:
        """What `name` said (Fatal) before it died, handling what else is in the inbox. An
        actor that exits FATAL_EXIT_CODE sent one before exiting, but it may still be in
        flight: wait up to `wait` seconds for it."""
        deadline = time.monotonic() + wait
        while name not in self.fatal:
            msg = self.inbox.recv(max(0, int((deadline - time.monotonic()) * 1000)))
            if msg is None:
                break
            self._handle(msg)
        return self.fatal.pop(name, None)

    def _respawn(self, name: str) -> None:
        role, _, index = name.partition(" ")
        self._spawn(role, int(index or 0))
        self._await_ready()

    def _restart_core(self, reason: str) -> None:
        self.gateway_channel.send(EngineEvent("down", reason))
        notify(f"STATUS=restarting the engine: {reason}")
        core = [actor_name(r, i) for r, i in self._core()]
        _terminate([self.children.pop(n) for n in core if n in self.children], STOP_TIMEOUT)
        self.step_running_for = 0.0
        for role, index in self._core():
            self._spawn(role, index)
        self._await_ready()
        self.gateway_channel.send(EngineEvent("up", "engine restarted"))
        notify(f"STATUS=serving {self.config.model.served_model_name}")

    # -- stopping ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain the gateway, then stop every actor; remove the run directory."""
        gateway = self.children.pop("gateway", None)
        if gateway is not None:
            log.info("stopping: the gateway drains (in-flight requests finish, up to %.0f s), "
                     "then the actors stop", self.config.server.drain_timeout)
            notify("STATUS=draining")
            _terminate([gateway], self.config.server.drain_timeout + STOP_TIMEOUT)
        spares = self.spares.stop() if self.spares else []
        _terminate(list(self.children.values()) + spares, STOP_TIMEOUT)
        self.children.clear()
        for channel in (self.inbox, getattr(self, "gateway_channel", None),
                        getattr(self, "scheduler_channel", None)):
            if channel is not None:
                channel.sock.setsockopt(zmq.LINGER, 0)
                channel.close()
        self.ctx.term()
        if self.config.run_dir:
            shutil.rmtree(self.config.run_dir, ignore_errors=True)
        log.info("stopped")


def _terminate(procs: list[subprocess.Popen], timeout: float) -> None:
    """Stop actors (the gateway drains first on this signal), SIGKILL past the timeout."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(STOP_SIGNAL)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("actor pid %d did not stop within %.0f s: killed", p.pid, timeout)
            p.kill()
            p.wait()
