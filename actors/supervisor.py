"""The supervisor: starts every actor, waits for each one's Ready, and stops them all.

Start order follows the pipeline's dependencies: executors (the slow model load), scheduler,
detokenizer, tokenizers start together and are awaited; the gateway starts last, so nothing
listens for HTTP before the engine can serve. On SIGINT/SIGTERM the gateway drains first
(in-flight requests finish, new ones get 503), then the others are stopped; the run
directory with its sockets is removed. If an actor dies, everything is stopped and the
supervisor exits non-zero (restarts come with the operations issue).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import zmq

from pagewire.wire.channels import PullChannel, ipc_address, make_run_dir
from pagewire.wire.to_supervisor import Fatal, Ready, SupervisorInbox

from .config import EngineConfig

log = logging.getLogger("supervisor")
START_TIMEOUT = 300.0
STOP_TIMEOUT = 10.0


class ActorFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.children: dict[str, subprocess.Popen] = {}
        self.ready: set[str] = set()
        self.stop_requested = False
        self.ctx = zmq.Context()
        self.inbox: PullChannel | None = None

    def run(self) -> int:
        """Serve until a signal or an actor's death. Returns the process exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.start()
            log.info("serving %s on http://%s:%d", self.config.served_model_name,
                     self.config.host, self.config.port)
            self.watch()
            return 0
        except (ActorFailed, ValueError, OSError) as e:
            log.error("%s", e)
            return 1
        finally:
            self.stop()

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    def start(self) -> None:
        run_dir = make_run_dir(os.environ.get("RUNTIME_DIRECTORY"))
        self.config.run_dir = run_dir
        config_path = os.path.join(run_dir, "config.json")
        with open(os.open(config_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(self.config.to_json())
        self.inbox = PullChannel(self.ctx, ipc_address(run_dir, "supervisor"), SupervisorInbox)
        engine = [("executor", 0), ("scheduler", 0), ("detokenizer", 0)] + \
                 [("tokenizer", i) for i in range(self.config.num_tokenizers)]
        for role, index in engine:
            self._spawn(role, index, config_path)
        self._await_ready()
        self._spawn("gateway", 0, config_path)
        self._await_ready()

    def _spawn(self, role: str, index: int, config_path: str) -> None:
        name = role if role in ("scheduler", "detokenizer", "gateway") else f"{role} {index}"
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", "pagewire.process", role, config_path, str(index)])

    def _await_ready(self) -> None:
        """Wait until every actor started so far has said Ready."""
        ready = self.ready
        deadline = time.monotonic() + START_TIMEOUT
        while len(ready) < len(self.children):
            if self.stop_requested:
                raise ActorFailed("stopped while starting")
            if time.monotonic() > deadline:
                raise ActorFailed(f"actors not ready after {START_TIMEOUT:.0f}s: "
                                  f"{sorted(set(self.children) - ready)}")
            msg = self.inbox.recv(200)
            if isinstance(msg, Fatal):
                raise ActorFailed(f"{msg.actor} failed to start: {msg.message}")
            if isinstance(msg, Ready):
                ready.add(msg.actor)
                log.info("%s ready (pid %d)", msg.actor, msg.pid)
            self._check_alive()

    def watch(self) -> None:
        while not self.stop_requested:
            msg = self.inbox.recv(200)
            if isinstance(msg, Fatal):
                raise ActorFailed(f"{msg.actor} failed: {msg.message}")
            self._check_alive()

    def _check_alive(self) -> None:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                raise ActorFailed(f"{name} exited with code {proc.returncode}")

    def stop(self) -> None:
        """Drain the gateway, then stop every actor; remove the run directory."""
        gateway = self.children.pop("gateway", None)
        if gateway is not None:
            _terminate([gateway], self.config.drain_timeout + STOP_TIMEOUT)
        _terminate(list(self.children.values()), STOP_TIMEOUT)
        self.children.clear()
        if self.inbox is not None:
            self.inbox.close()
        self.ctx.term()
        if self.config.run_dir:
            shutil.rmtree(self.config.run_dir, ignore_errors=True)


def _terminate(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
