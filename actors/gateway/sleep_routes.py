"""Sleep mode's routes (--enable-sleep-mode; docs/sleep-mode.md), vLLM's names and shapes:
POST /sleep?level=1|2[&mode=abort|wait], POST /wake_up[?tags=weights&tags=kv_cache],
GET /is_sleeping -> {"is_sleeping": bool}; and POST /update_weights (also SGLang's
/update_weights_from_disk) with {"model_path": ...} (or "path"), answered in SGLang's shape.

Each control crosses to the scheduler (wire/engine_control.py), which ends or drains the
requests in flight and hands it to the executors; the answer comes back by req_id. While
anything is asleep, generation and pooling requests get 503 here (vLLM's answer), and the
scheduler refuses any that raced past. A new checkpoint is checked here first
(weight_updates.py): a wrong path, kind, architecture or shape is a 400 before the engine
pauses, and the old weights keep serving. Without --enable-sleep-mode every route is a 404.
"""
from __future__ import annotations

import asyncio
import itertools

import msgspec
from aiohttp import web

from pagewire.wire.engine_control import (ABORT, MODES, TAGS, WAIT, ControlDone, EngineControl,
                                          SleepEngine, UpdateWeights, WakeEngine)
from pagewire.wire.to_gateway import RequestFailed

from ..weight_updates import WeightsRefused, resolve_update
from .protocol import ApiError, decode_body

_ERROR_TYPES = {400: "BadRequestError", 409: "ConflictError"}
PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/update_weights")   # behind the API keys


class UpdateBody(msgspec.Struct, kw_only=True):
    model_path: str | None = None          # SGLang's name
    path: str | None = None
    abort_all_requests: bool = False       # SGLang's: abort, rather than finish, those running
    load_format: str | None = None         # SGLang's; only the model's own format is read


class SleepRoutes:
    def __init__(self, gateway):
        self.gateway = gateway
        self.enabled = gateway.config.model.enable_sleep_mode
        self.asleep: list[str] = []        # what the engine holds asleep (its last answer)
        self.busy = False                  # a control is in progress
        self.ids = itertools.count()

    def routes(self) -> list:
        return [web.post("/sleep", self.sleep), web.post("/wake_up", self.wake_up),
                web.get("/is_sleeping", self.is_sleeping),
                web.post("/update_weights", self.update_weights),
                web.post("/update_weights_from_disk", self.update_weights)]

    def check_awake(self) -> None:
        """503 for a request that needs the weights while anything is asleep."""
        if self.asleep:
            raise ApiError(503, f"the model is sleeping ({', '.join(self.asleep)} asleep): "
                           "POST /wake_up first", error_type="ServiceUnavailableError")

    def engine_restarted(self) -> None:
        """The engine core came back after a restart: it starts awake."""
        self.asleep = []

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ApiError(404, "sleep mode is off: start the server with --enable-sleep-mode",
                           error_type="NotFoundError")

    async def is_sleeping(self, request: web.Request) -> web.Response:
        self._check_enabled()
        return web.json_response({"is_sleeping": bool(self.asleep)})

    async def sleep(self, request: web.Request) -> web.Response:
        self._check_enabled()
        level = _int_query(request, "level", 1)
        mode = request.query.get("mode", ABORT)
        if level not in (1, 2):
            raise ApiError(400, f"level must be 1 or 2, got {level}", "level")
        if mode not in MODES:
            raise ApiError(400, f"mode must be one of {', '.join(MODES)}, got {mode!r}", "mode")
        done = await self._ask(SleepEngine(req_id=self._id(), level=level, mode=mode))
        return web.json_response({"is_sleeping": bool(done.asleep), "asleep": done.asleep,
                                  "aborted_requests": done.aborted})

    async def wake_up(self, request: web.Request) -> web.Response:
        self._check_enabled()
        tags = request.query.getall("tags", [])
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ApiError(400, f"tags are {' and '.join(TAGS)}, got {', '.join(unknown)}",
                           "tags")
        done = await self._ask(WakeEngine(req_id=self._id(), tags=tags))
        return web.json_response({"is_sleeping": bool(done.asleep), "asleep": done.asleep})

    async def update_weights(self, request: web.Request) -> web.Response:
        self._check_enabled()
        body = decode_body(await request.read() or b"{}", UpdateBody)
        path = body.model_path or body.path
        try:
            resolve_update(self.gateway.config.model.model_info, path)
        except WeightsRefused as e:
            raise ApiError(400, str(e), "model_path") from None
        done = await self._ask(UpdateWeights(req_id=self._id(), path=path,
                                             mode=ABORT if body.abort_all_requests else WAIT))
        return web.json_response({"success": True, "message": f"weights loaded from {path}",
                                  "num_paused_requests": done.aborted,
                                  "is_sleeping": bool(done.asleep)})

    def _id(self) -> str:
        return f"control-{next(self.ids)}"

    async def _ask(self, msg: EngineControl) -> ControlDone:
        """Send a control to the scheduler and wait for its answer (or the engine's restart:
        503). One at a time: another meanwhile is a 409."""
        if self.busy:
            raise ApiError(409, "another sleep, wake-up or weight update is in progress",
                           error_type="ConflictError")
        self.busy = True
        queue: asyncio.Queue = asyncio.Queue()
        self.gateway.routes[msg.req_id] = queue
        try:
            self.gateway.scheduler.send(msg)
            reply = await queue.get()
        finally:
            self.gateway.routes.pop(msg.req_id, None)
            self.busy = False
        if isinstance(reply, RequestFailed):
            raise ApiError(reply.status, reply.message, error_type=reply.error_type)
        self.asleep = list(reply.asleep)
        if reply.status != 200:
            raise ApiError(reply.status, reply.error or "failed",
                           error_type=_ERROR_TYPES.get(reply.status, "InternalServerError"))
        return reply


def _int_query(request: web.Request, name: str, default: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name) from None
