"""The gateway actor: aiohttp on uvloop. It starts beside the engine's actors and builds its
routes meanwhile, but opens its HTTP port only on the supervisor's EngineReady (nothing serves
HTTP before the engine can); Ready once listening. SIGTERM or the supervisor's stop signal
drains (in-flight requests finish, new ones get 503), then exits."""
from __future__ import annotations

import asyncio
import signal

import uvloop
from aiohttp import web

from ..process import STOP_SIGNAL
from .server import Gateway


async def _serve(env) -> None:
    gateway = Gateway(env.config, env.address, env.tracer)
    pump = asyncio.get_running_loop().create_task(gateway.pump())
    runner = web.AppRunner(gateway.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, STOP_SIGNAL):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    beat = asyncio.get_running_loop().create_task(_heartbeats(env))
    if await _first(gateway.engine_ready, stop) is gateway.engine_ready:
        await web.TCPSite(runner, env.config.server.host, env.config.server.port).start()
        env.ready()
        await stop.wait()
    beat.cancel()
    await gateway.drain(env.config.server.drain_timeout)
    await runner.cleanup()
    pump.cancel()


async def _first(*events: asyncio.Event) -> asyncio.Event:
    """Wait until one of the events is set; returns it."""
    waits = {asyncio.ensure_future(e.wait()): e for e in events}
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return waits[next(iter(done))]


async def _heartbeats(env) -> None:
    """Sent from the event loop itself: a blocked loop stops them."""
    while True:
        env.heartbeat()
        await asyncio.sleep(1.0)


def run(env) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(env))
