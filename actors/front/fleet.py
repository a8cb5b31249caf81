"""The front's models and the rules for loading and unloading them.

- A request for a model that is not loaded starts its load and waits for it (at most
  --model-load-timeout seconds, at most --model-queue-size requests a model); a load that
  fails answers every waiter with a 503 naming why, and the next request tries again.
- Before a load, room is made: while the loaded models plus this one would pass
  --max-loaded-models or --models-memory-budget, the least recently used idle model (not
  pinned, nothing in flight or waiting) is unloaded; with no such model left, a 503.
- Housekeeping (twice a second): a model idle past its idle timeout is unloaded; a loaded
  model whose engine exited (its supervisor gave up) counts as failed until asked again.
Decisions about room are taken one at a time (`room`), so two loads never both count on
the same free memory. Imports no torch.
"""
from __future__ import annotations

import asyncio
import logging
import time

from .model_engine import ModelEngine
from .models_file import ModelEntry, scan_models_dir

log = logging.getLogger("front")
HOUSEKEEPING_PERIOD = 0.5
HEALTH_PERIOD = 5.0       # seconds between the loaded engines' /health checks
LOAD_LIMIT = 330.0        # seconds a load may take (the engine's own start limit, and some)


class FleetError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Fleet:
    def __init__(self, entries: list[ModelEntry], fleet, front_values: dict, config_dir: str,
                 drain_timeout: float, make_engine=ModelEngine):
        self.fleet, self.front_values, self.config_dir = fleet, front_values, config_dir
        self.drain_timeout, self.make_engine = drain_timeout, make_engine
        self.engines: dict[str, ModelEngine] = {}
        self.adapters: dict[str, str] = {}           # adapter name -> its model's name
        for entry in entries:
            self.add(entry)
        self.room = asyncio.Lock()
        self.loads: dict[str, asyncio.Task] = {}
        self.waiting: dict[str, int] = {}

    def add(self, entry: ModelEntry) -> None:
        if entry.name in self.engines or entry.name in self.adapters:
            raise ValueError(f"two models are named {entry.name!r}")
        self.engines[entry.name] = self.make_engine(entry)
        for adapter in entry.adapters:
            self.adapters.setdefault(adapter, entry.name)

    def lookup(self, name: str) -> ModelEngine | None:
        """The engine serving `name` (a model, one of its adapters; Ollama's `:latest` tag
        ignored). A models directory is read again for a name it did not hold."""
        for key in (name, name.removesuffix(":latest")):
            if key in self.engines:
                return self.engines[key]
            if key in self.adapters:
                return self.engines[self.adapters[key]]
        if self.fleet.models_dir:
            for entry in scan_models_dir(self.fleet.models_dir):
                if entry.name not in self.engines:
                    self.add(entry)
            return self.engines.get(name.removesuffix(":latest"))
        return None

    def default(self) -> ModelEngine:
        """Where a request naming no model goes: the first pinned model, else the first."""
        engines = list(self.engines.values())
        return next((e for e in engines if e.entry.pinned), engines[0])

    # -- using a model -------------------------------------------------------------------------

    async def acquire(self, engine: ModelEngine) -> None:
        """Wait until `engine` is loaded (starting its load) and count a request in flight
        on it. Raises FleetError (503) when its load fails, times out or is over-queued."""
        if engine.state == "loaded":
            engine.in_flight += 1
            return
        name = engine.name
        if self.waiting.get(name, 0) >= self.fleet.model_queue_size:
            raise FleetError(503, f"model {name!r} is loading and {self.fleet.model_queue_size}"
                             " requests already wait for it; retry later")
        self.waiting[name] = self.waiting.get(name, 0) + 1
        try:
            await asyncio.wait_for(self._until_loaded(engine), self.fleet.model_load_timeout)
        except asyncio.TimeoutError:
            raise FleetError(503, f"model {name!r} is still {engine.state} after "
                             f"{self.fleet.model_load_timeout:.0f}s; retry later") from None
        finally:
            self.waiting[name] -= 1
        engine.in_flight += 1

    async def _until_loaded(self, engine: ModelEngine) -> None:
        attempted = False
        while engine.state != "loaded":
            task = self.loads.get(engine.name)
            if engine.state in ("unloaded", "failed") and (task is None or task.done()):
                if attempted:
                    raise FleetError(503, f"model {engine.name!r} could not be loaded: "
                                     f"{engine.reason}")
                self.loads[engine.name] = asyncio.create_task(self.load(engine))
                attempted = True
            changed = engine.changed
            await changed.wait()

    def release(self, engine: ModelEngine) -> None:
        engine.in_flight -= 1
        engine.last_used = time.monotonic()

    # -- loading and unloading -----------------------------------------------------------------

    async def load(self, engine: ModelEngine) -> None:
        """Make room, then load. A model that cannot get room, or whose load raised, ends
        `failed` with why (its waiters are told)."""
        try:
            await self._load(engine)
        except Exception as e:
            log.exception("loading %s", engine.name)
            engine.set_state("failed", f"{type(e).__name__}: {e}")

    async def _load(self, engine: ModelEngine) -> None:
        async with self.room:
            if engine.state in ("loaded", "loading"):
                return
            try:
                await self._make_room(engine)
            except FleetError as e:
                engine.set_state("failed", str(e))
                return
            engine.set_state("loading")          # counted against the room from here
        await engine.load(self.front_values, self.config_dir, LOAD_LIMIT)

    async def _make_room(self, engine: ModelEngine) -> None:
        need, budget, most = engine.footprint(), self.fleet.models_memory_budget, \
            self.fleet.max_loaded_models
        if budget and need > budget:
            raise FleetError(503, f"it needs {need >> 20} MiB, more than the whole "
                             f"--models-memory-budget ({budget >> 20} MiB)")
        while True:
            held = [e for e in self.engines.values()
                    if e is not engine and e.state in ("loaded", "loading", "unloading")]
            used = sum(e.footprint() for e in held)
            if not (most and len(held) >= most) and not (budget and used + need > budget):
                return
            idle = sorted((e for e in held if self._idle(e)), key=lambda e: e.last_used)
            if not idle:
                raise FleetError(503, f"no room: {len(held)} models hold {used >> 20} MiB and "
                                 "none is idle and unpinned to unload; retry later")
            await idle[0].unload(self.drain_timeout,
                                 f"unloaded to make room for {engine.name!r} (least recently used)")

    def _idle(self, engine: ModelEngine) -> bool:
        return engine.state == "loaded" and not engine.entry.pinned and \
            engine.in_flight == 0 and not self.waiting.get(engine.name)

    async def unload(self, engine: ModelEngine, reason: str, if_idle: bool = False) -> None:
        """Unload `engine` (its requests in flight finish first); with if_idle, only if it is
        still idle once room decisions are its own."""
        async with self.room:
            if not if_idle or self._idle(engine):
                await engine.unload(self.drain_timeout, reason)

    async def start(self) -> None:
        """Load the pinned models; raises ValueError when one fails (the server cannot start)."""
        pinned = [e for e in self.engines.values() if e.entry.pinned]
        for engine in pinned:
            await self.load(engine)
            if engine.state != "loaded":
                raise ValueError(f"pinned model {engine.name!r} failed to load: {engine.reason}")

    async def stop(self) -> None:
        await asyncio.gather(*(e.unload(self.drain_timeout, "the server is stopping")
                               for e in self.engines.values() if e.proc is not None))

    async def housekeeping(self) -> None:
        """Twice a second: engines that exited, idle models; every HEALTH_PERIOD, hung ones."""
        next_health = 0.0
        while True:
            await asyncio.sleep(HOUSEKEEPING_PERIOD)
            now = time.monotonic()
            for engine in list(self.engines.values()):
                if engine.exited():
                    code = engine.proc.returncode
                    engine.proc = None
                    engine.set_state("failed", f"its engine exited with code {code}")
                    log.error("%s: its engine exited with code %s", engine.name, code)
                idle = engine.entry.idle_timeout if engine.entry.idle_timeout is not None \
                    else self.fleet.model_idle_timeout
                if idle and self._idle(engine) and now - engine.last_used > idle:
                    asyncio.create_task(self.unload(engine, f"idle for {idle:g}s", if_idle=True))
            if now >= next_health:
                next_health = now + HEALTH_PERIOD
                await self.restart_hung()

    async def restart_hung(self) -> None:
        """An engine whose gateway says a step has stalled (a hung executor) is unloaded, not
        the whole server: alone, systemd's watchdog would restart the service; here the other
        models serve on, and its next request loads it again."""
        for engine in [e for e in self.engines.values() if e.state == "loaded"]:
            why = await engine.hung()
            if why:
                log.error("%s: %s; unloading it", engine.name, why)
                asyncio.create_task(self.unload(engine, f"unloaded: {why}"))
