"""One model's engine under the front: a whole `pagewire serve` (its supervisor, gateway,
tokenizers, scheduler, executors, detokenizer) on a private loopback port.

A model is its own process tree so that one model's crash, restart or unload touches no
other, and unloading returns every byte to the system (the tree exits). Its supervisor
restarts its own actors as it would alone; the front only sees the tree exit when that
supervisor gives up (or is killed), and then counts the model unloaded with the reason.

States: unloaded -> loading -> loaded -> unloading -> unloaded; a load that fails ends
`failed` (the next request tries again). Imports no torch.
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time

import aiohttp

from .models_file import ModelEntry, engine_values

log = logging.getLogger("front")
READY_POLL = 0.1                 # seconds between a loading engine's /health checks
STOP_GRACE = 15.0                # seconds past the drain before the tree is killed
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ModelEngine:
    def __init__(self, entry: ModelEntry):
        self.entry = entry
        self.state = "unloaded"
        self.reason = ""                     # why it failed or was unloaded last
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.in_flight = 0                   # requests proxied to it right now
        self.last_used = 0.0                 # time.monotonic() of its last request's end
        self.loads = 0
        self.load_seconds = 0.0              # how long its last load took
        self.measured = 0                    # bytes its tree held when last measured
        self.last_error = ""                 # the engine's last ERROR log line
        self.changed = asyncio.Event()       # set on every state change (waiters re-check)

    @property
    def name(self) -> str:
        return self.entry.name

    def set_state(self, state: str, reason: str = "") -> None:
        self.state, self.reason = state, reason
        self.changed.set()
        self.changed = asyncio.Event()

    def footprint(self) -> int:
        """Bytes it holds (or will once loaded): declared, else last measured, else its
        weight files and a process overhead (models_file.weights_bytes)."""
        from .models_file import weights_bytes
        if self.entry.memory is not None:
            return self.entry.memory
        return self.measured or weights_bytes(self.entry.path) + 2**30

    async def load(self, front_values: dict, config_dir: str, timeout: float) -> None:
        """Start the engine and wait for its /health: loaded, or failed with the reason."""
        port = free_port()
        values = engine_values(front_values, self.entry, port)
        path = os.path.join(config_dir, f"{self.name.replace(os.sep, '_')}.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)   # holds API keys
        with open(fd, "w") as f:
            json.dump(values, f)
        self.url = f"http://127.0.0.1:{port}"
        self.set_state("loading")
        started = time.monotonic()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagewire.cli", "serve", "--config", path,
            env=engine_env(), start_new_session=True,      # its own group: killed as one
            preexec_fn=_stop_with_front, stderr=asyncio.subprocess.PIPE)
        self.last_error = ""
        asyncio.create_task(self._pass_log(self.proc.stderr))
        log.info("loading %s (pid %d) from %s", self.name, self.proc.pid, self.entry.path)
        try:
            await asyncio.wait_for(self._until_healthy(), timeout)
        except (asyncio.TimeoutError, RuntimeError) as e:
            why = str(e) or f"not ready after {timeout:.0f}s"
            await self._kill()
            self.set_state("failed", why)
            log.error("%s failed to load: %s", self.name, why)
            return
        self.loads += 1
        self.load_seconds = time.monotonic() - started
        self.measured = tree_memory(self.proc.pid)
        self.last_used = time.monotonic()
        self.set_state("loaded")
        log.info("%s loaded in %.1fs (%d MiB)", self.name, self.load_seconds, self.measured >> 20)

    async def _until_healthy(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                if self.proc.returncode is not None:
                    await asyncio.sleep(0.05)                 # its last words, if in flight
                    raise RuntimeError(f"its engine exited with code {self.proc.returncode}"
                                       f": {self.last_error or 'see the server log'}")
                try:
                    async with session.get(f"{self.url}/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(READY_POLL)

    async def hung(self) -> str | None:
        """Why the engine counts as hung (its gateway's /health says a step stalled or the
        engine stopped answering), or None. A core that restarts is not hung: it is busy."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                async with s.get(f"{self.url}/health") as r:
                    status = (await r.json()).get("status", "") if r.status != 200 else "ok"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None                      # its exit, if it died, is seen on its own
        return status if status.startswith(("engine step stalled", "engine not responding")) \
            else None

    async def _pass_log(self, stream: asyncio.StreamReader) -> None:
        """The engine's log lines go on to the front's stderr (the journal) as they come; the
        last ERROR line is kept, to say why a load failed."""
        while line := await stream.readline():
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            text = line.decode(errors="replace")
            if " ERROR " in text:
                self.last_error = text.split(" ERROR ", 1)[1].strip()

    async def unload(self, drain_timeout: float, reason: str) -> None:
        """Stop the engine: its gateway drains (requests in flight finish, up to
        drain_timeout), then its tree exits; killed past STOP_GRACE more."""
        if self.proc is None:
            return
        self.set_state("unloading", reason)
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), drain_timeout + STOP_GRACE)
            except asyncio.TimeoutError:
                log.warning("%s did not stop in time: killed", self.name)
        await self._kill()
        self.set_state("unloaded", reason)
        log.info("%s unloaded: %s", self.name, reason)

    async def _kill(self) -> None:
        """SIGKILL whatever is left of the tree (the engine's actors share its group)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        await self.proc.wait()
        self.proc = None

    def exited(self) -> bool:
        """The engine's tree ended on its own (its supervisor gave up, or was killed)."""
        return self.state == "loaded" and self.proc is not None and \
            self.proc.returncode is not None


def _stop_with_front() -> None:
    """In the engine's process before it runs: SIGTERM it (it drains and stops its actors)
    when the front dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):        # not Linux: the front's own stop still ends it
        pass


def engine_env() -> dict:
    """The environment an engine starts in: the front's, less what the front already read
    (PAGEWIRE_* options are in the engine's config file, where they rank below the model's
    own) and systemd's notify socket (the front alone speaks to systemd)."""
    from ..options import OPTIONS
    drop = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} | {o.env for o in OPTIONS}
    return {k: v for k, v in os.environ.items() if k not in drop}


def tree_memory(pid: int) -> int:
    """Proportional set size (bytes) of a process and its descendants: shared libraries
    counted once across them, as the system would get back if the tree exited."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        out += kids
        frontier = kids
    return out
