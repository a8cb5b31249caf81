"""The front's HTTP side in one process: API keys before anything loads, the relay to a
model's engine (an aiohttp app standing in for one), error shapes by API."""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pagewire.config_sections import FleetConfig, ServerConfig
from pagewire.front.fleet import Fleet
from pagewire.front.models_file import ModelEntry
from pagewire.front.server import Front
from tests.front.test_fleet import FakeEngine


async def _engine_app() -> TestServer:
    """A model's engine: echoes what it was sent, streams three chunks."""
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "X-Seen-Key": request.headers.get("Authorization", "")})
        await response.prepare(request)
        for part in (b"data: 1\n\n", b"data: " + body + b"\n\n", b"data: [DONE]\n\n"):
            await response.write(part)
        return response
    app = web.Application()
    app.router.add_post("/v1/chat/completions", echo)
    server = TestServer(app)
    await server.start_server()
    return server


def _run(check) -> None:
    async def main():
        engine_server = await _engine_app()
        FakeEngine.events, FakeEngine.failing, FakeEngine.gate = [], set(), None
        fleet = Fleet([ModelEntry("chat", "/m/chat", adapters=("sql",)),
                       ModelEntry("embed", "/m/embed")], FleetConfig(), {}, "/none", 1.0,
                      make_engine=FakeEngine)
        for engine in fleet.engines.values():
            engine.url = str(engine_server.make_url("")).rstrip("/")
        front = Front(fleet, ServerConfig(api_keys=["k1"]))
        await front.open()
        client = TestClient(TestServer(front.app()))
        await client.start_server()
        try:
            await check(client, fleet)
        finally:
            await client.close()
            await front.close()
            await engine_server.close()
    asyncio.run(main())


def test_keys_are_checked_before_any_model_loads_and_the_answer_streams_through():
    async def check(client, fleet):
        r = await client.post("/v1/chat/completions", json={"model": "chat"})
        assert r.status == 401 and fleet.engines["chat"].state == "unloaded"
        assert (await client.get("/health")).status == 200
        r = await client.post("/v1/chat/completions", data=b'{"model": "sql", "x": 1}',
                              headers={"Authorization": "Bearer k1"})
        assert r.status == 200 and r.headers["X-Seen-Key"] == "Bearer k1"
        assert await r.read() == b'data: 1\n\ndata: {"model": "sql", "x": 1}\n\ndata: [DONE]\n\n'
        assert FakeEngine.events == [("load", "chat")] and fleet.engines["chat"].in_flight == 0
    _run(check)


def test_an_unknown_model_is_a_404_in_the_shape_of_the_api_asked():
    async def check(client, fleet):
        key = {"Authorization": "Bearer k1"}
        r = await client.post("/v1/messages", json={"model": "nope"}, headers=key)
        assert r.status == 404 and await r.json() == {"type": "error", "error": {
            "type": "not_found_error",
            "message": "model 'nope' is not served here; served: chat, embed"}}
        r = await client.post("/api/chat", json={"model": "nope:latest"}, headers=key)
        assert r.status == 404 and await r.json() == {
            "error": "model 'nope:latest' is not served here; served: chat, embed"}
        r = await client.get("/v1/models", headers=key)
        assert [(m["id"], m["parent"], m["status"]["value"]) for m in (await r.json())["data"]] \
            == [("chat", None, "unloaded"), ("sql", "chat", "unloaded"),
                ("embed", None, "unloaded")]
    _run(check)
