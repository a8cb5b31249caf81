"""The gateway actor: aiohttp on uvloop. Ready once listening; SIGTERM drains, then exits."""
from __future__ import annotations

import asyncio
import signal

import uvloop
from aiohttp import web

from .server import Gateway


async def _serve(env) -> None:
    gateway = Gateway(env.config, env.address)
    pump = asyncio.get_running_loop().create_task(gateway.pump())
    runner = web.AppRunner(gateway.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, env.config.host, env.config.port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    env.ready()
    await stop.wait()
    await gateway.drain(env.config.drain_timeout)
    await runner.cleanup()
    pump.cancel()


def run(env) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(env))
