"""`pagewire serve --models-file F` (or `--models-dir D`): several models behind one endpoint.

The front is the process systemd starts. It reads the models, loads the pinned ones (READY=1
once they serve), then answers on --host/--port, starting each other model's engine on its
first request (fleet.py) and relaying to it (server.py). On SIGTERM every engine drains and
stops, then the front exits. Imports no torch: an engine's executors are the only processes
that load it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil

from aiohttp import web

from pagewire.wire.channels import make_run_dir

from ..options import convert
from ..sd_notify import notify, watchdog_period
from .fleet import Fleet
from .models_file import read_models_file, scan_models_dir
from .server import Front

log = logging.getLogger("front")


def run_front(values: dict) -> int:
    """Serve the models the options name. `values`: every option given (flags, environment,
    config file), before defaults: what each model's engine starts from."""
    if values.get("model"):
        log.error("MODEL and --models-file / --models-dir exclude each other: name each "
                  "model in the models file")
        return 2
    try:
        config = convert(dict(values))
        fleet_config = config.fleet
        entries = read_models_file(fleet_config.models_file) if fleet_config.models_file \
            else scan_models_dir(fleet_config.models_dir)
        if not entries:
            raise ValueError(f"{fleet_config.models_dir}: no GGUF file or model directory")
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    config_dir = make_run_dir(os.environ.get("RUNTIME_DIRECTORY"))
    try:
        return _serve(config, entries, values, config_dir)
    finally:
        shutil.rmtree(config_dir, ignore_errors=True)


async def _watchdog() -> None:
    """systemd's watchdog (WatchdogSec=): pinged while the front's loop runs. A hung engine
    is the front's to restart (fleet.restart_hung), not systemd's: the other models serve on."""
    period = watchdog_period()
    while period:
        notify("WATCHDOG=1")
        await asyncio.sleep(period)


def _serve(config, entries, values: dict, config_dir: str) -> int:
    server = config.server
    fleet = Fleet(entries, config.fleet, values, config_dir, server.drain_timeout)
    front = Front(fleet, server)
    app = front.app()
    failed: list[str] = []

    async def started(_app) -> None:
        await front.open()
        try:
            await fleet.start()
        except ValueError as e:               # cleanup hooks do not run after a failed start
            failed.append(str(e))
            await fleet.stop()
            await front.close()
            raise web.GracefulExit() from None
        _app["housekeeping"] = asyncio.create_task(fleet.housekeeping())
        _app["watchdog"] = asyncio.create_task(_watchdog())
        log.info("serving %d models on http://%s:%d: %s", len(fleet.engines), server.host,
                 server.port, ", ".join(fleet.engines))
        notify(f"READY=1\nSTATUS=serving {len(fleet.engines)} models")

    async def stopping(_app) -> None:
        notify("STOPPING=1")
        for task in (_app.get("housekeeping"), _app.get("watchdog")):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await fleet.stop()
        await front.close()

    app.on_startup.append(started)
    app.on_cleanup.append(stopping)
    try:
        web.run_app(app, host=server.host, port=server.port, print=None)
    except web.GracefulExit:
        pass
    if failed:
        log.error("%s", failed[0])
        return 1
    return 0
