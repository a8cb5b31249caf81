"""The front's HTTP side: one endpoint for every model of a models file or directory.

A request is relayed, as it is, to the engine of the model its JSON body (else its query)
names in `model` (a model's LoRA adapter names that model's engine; naming none, to the
default model: the first pinned, else the first listed), after that model is loaded; the answer,
an event stream included, comes back as the engine sends it, and a client that goes away
closes the engine's connection too (the engine aborts the request). The front answers
itself: `GET /v1/models` (every model with its state), llama.cpp's `GET /models`,
`POST /models/load` and `POST /models/unload` ({"model": name}), Ollama's `GET /api/tags`,
`/health` and `/metrics` (every loaded engine's, each sample labelled with its model, and
the front's own). API keys are checked here before any model loads, and again by the engine.
Imports no torch.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time

import aiohttp
from aiohttp import web

from ..router_http import end_to_end, relay
from .fleet import Fleet, FleetError
from .front_metrics import front_metrics, labelled
from .model_engine import ModelEngine

MAX_BODY_BYTES = 64 * 2**20


class Front:
    def __init__(self, fleet: Fleet, server):
        self.fleet, self.server = fleet, server
        self.created = int(time.time())
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self.keys])
        app.router.add_routes([
            web.get("/health", self.health), web.get("/metrics", self.metrics),
            web.get("/v1/models", self.models), web.get("/models", self.models),
            web.post("/models/load", self.load), web.post("/models/unload", self.unload),
            web.get("/api/tags", self.ollama_tags),
            web.route("*", "/{tail:.*}", self.relay)])
        return app

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    @web.middleware
    async def keys(self, request: web.Request, handler):
        """Every route but /health (and /metrics unless asked) needs a configured key."""
        guarded = request.path != "/health" and (
            request.path != "/metrics" or self.server.metrics_require_api_key)
        if guarded and self.server.api_keys and not self._keyed(request):
            return error(request.path, 401, "invalid or missing API key")
        return await handler(request)

    def _keyed(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else \
            request.headers.get("x-api-key", "").strip()
        matched = False
        for key in self.server.api_keys:          # no early exit: timing tells nothing
            matched |= hmac.compare_digest(given.encode(), key.encode())
        return matched

    # -- relaying ------------------------------------------------------------------------------

    async def relay(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        name = named_model(body) or request.query.get("model")     # /sleep?model=chat
        engine = self.fleet.lookup(name) if name else self.fleet.default()
        if engine is None:
            return error(request.path, 404, f"model {name!r} is not served here; served: "
                         f"{', '.join(self.fleet.engines)}")
        try:
            await self.fleet.acquire(engine)
        except FleetError as e:
            return error(request.path, e.status, str(e))
        try:
            return await self._forward(request, engine, body)
        finally:
            self.fleet.release(engine)

    async def _forward(self, request: web.Request, engine: ModelEngine,
                       body: bytes) -> web.StreamResponse:
        try:
            return await relay(self.session, request, engine.url + request.path_qs, body,
                               end_to_end(request.headers), method=request.method)
        except aiohttp.ClientConnectorError:
            return error(request.path, 503, f"model {engine.name!r}'s engine cannot be "
                         "reached (it is restarting); retry the request")

    # -- the front's own routes ----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "models": {
            e.name: e.state for e in self.fleet.engines.values()}})

    async def models(self, request: web.Request) -> web.Response:
        data = []
        for e in self.fleet.engines.values():
            status = {"value": e.state, **({"reason": e.reason} if e.reason else {})}
            data.append({"id": e.name, "object": "model", "created": self.created,
                         "owned_by": "pagewire", "root": e.entry.path, "parent": None,
                         "pinned": e.entry.pinned, "status": status})
            data += [{"id": a, "object": "model", "created": self.created,
                      "owned_by": "pagewire", "root": a, "parent": e.name, "status": status}
                     for a in e.entry.adapters]
        return web.json_response({"object": "list", "data": data})

    async def ollama_tags(self, request: web.Request) -> web.Response:
        from .models_file import weights_bytes
        return web.json_response({"models": [
            {"name": e.name, "model": e.name, "size": weights_bytes(e.entry.path),
             "digest": "", "details": {"format": "gguf" if e.entry.path.endswith(".gguf")
                                       else "safetensors"}}
            for e in self.fleet.engines.values()]})

    async def load(self, request: web.Request) -> web.Response:
        """llama.cpp's router: load a model by its served name (never a path)."""
        engine = await self._named(request)
        if isinstance(engine, web.Response):
            return engine
        try:
            await self.fleet.acquire(engine)
        except FleetError as e:
            return error(request.path, e.status, str(e))
        self.fleet.release(engine)
        return web.json_response({"success": True, "model": engine.name, "state": engine.state})

    async def unload(self, request: web.Request) -> web.Response:
        """Unload a model: its requests in flight finish first (its engine drains)."""
        engine = await self._named(request)
        if isinstance(engine, web.Response):
            return engine
        if engine.state == "unloaded":
            return error(request.path, 400, f"model {engine.name!r} is not loaded")
        await self.fleet.unload(engine, "unloaded by request")
        return web.json_response({"success": True, "model": engine.name, "state": engine.state})

    async def _named(self, request: web.Request) -> ModelEngine | web.Response:
        name = named_model(await request.read())
        if not name:
            return error(request.path, 400, "expected a JSON body {\"model\": name}")
        engine = self.fleet.engines.get(name) or self.fleet.lookup(name)
        if engine is None:
            return error(request.path, 404, f"model {name!r} is not served here (models load "
                         f"by their served name, never a path); served: "
                         f"{', '.join(self.fleet.engines)}")
        return engine

    async def metrics(self, request: web.Request) -> web.Response:
        loaded = [e for e in self.fleet.engines.values() if e.state == "loaded"]
        texts = await asyncio.gather(*(self._engine_metrics(e) for e in loaded))
        text = labelled([(e.name, t) for e, t in zip(loaded, texts) if t],
                        front_metrics(self.fleet.engines.values()))
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def _engine_metrics(self, engine: ModelEngine) -> str:
        keys = self.server.api_keys
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        try:
            async with self.session.get(f"{engine.url}/metrics", headers=headers) as r:
                return await r.text() if r.status == 200 else ""
        except aiohttp.ClientError:
            return ""


def named_model(body: bytes) -> str | None:
    """The `model` a JSON body names; None for another body or none."""
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) and model else None


def error(path: str, status: int, message: str) -> web.Response:
    """`message` in the shape of the API asked: Ollama's, Anthropic's, else OpenAI's."""
    if path.startswith("/api/"):
        return web.json_response({"error": message}, status=status)
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
        status, "ServiceUnavailableError")
    if path.startswith("/v1/messages"):
        anthropic = {400: "invalid_request_error", 401: "authentication_error",
                     404: "not_found_error"}.get(status, "overloaded_error")
        return web.json_response({"type": "error", "error": {"type": anthropic,
                                                             "message": message}}, status=status)
    return web.json_response({"error": {"message": message, "type": kind, "param": "model"
                                        if status == 404 else None, "code": status}},
                             status=status)
