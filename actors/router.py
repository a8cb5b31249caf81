"""`pagewire router`: an OpenAI endpoint in front of pagewire engines.

    pagewire router --prefill http://10.0.0.5:8100 --decode http://10.0.0.6:8200 [--port 8000]

Disaggregated prefill and decode, vLLM's proxy flow (wire/kv_transfer.py): each completion or
chat request goes first to a prefill engine (round robin) with max_tokens 1, not streamed,
and `kv_transfer_params: {"do_remote_decode": true}`; its answer's `kv_transfer_params` are
added to the original request, which goes to a decode engine (round robin) and is answered
from there, streamed or not, as it comes. A prefill engine that answers with an error ends
the request with that answer; one that cannot be reached sends the request to a decode
engine without transfer parameters (it computes the prompt itself); a decode engine that
cannot be reached (nothing sent yet) passes the request to the next. /v1/models and /metrics
are the first decode engine's; /health is 200 when every engine answers its own. aiohttp
only, no torch.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging

import aiohttp
from aiohttp import web

log = logging.getLogger("router")
ROUTES = ("/v1/completions", "/v1/chat/completions")
_PASSED = ("Authorization", "X-Request-Id")     # request headers the engines see too


def add_command(sub) -> None:
    p = sub.add_parser("router", help="an OpenAI endpoint in front of prefill and decode "
                                      "engines (disaggregated prefill/decode)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill engines (started with kv_role kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode engines (kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


class Router:
    def __init__(self, prefill: list[str], decode: list[str]):
        self.prefill, self.decode = prefill, decode
        self.next_prefill, self.next_decode = itertools.cycle(prefill), itertools.cycle(decode)
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_routes([web.post(r, self.generate) for r in ROUTES] +
                              [web.get("/v1/models", self.passthrough),
                               web.get("/metrics", self.passthrough),
                               web.get("/health", self.health)])
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def _close(self, _app) -> None:
        await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        headers = _passed_headers(request)
        prefilled = await self._prefill(request.path, body, headers)
        if isinstance(prefilled, web.Response):
            return prefilled
        if prefilled:
            body = {**body, "kv_transfer_params": prefilled}
        for _ in range(len(self.decode)):     # one not reached: the request has not started
            url = f"{next(self.next_decode)}{request.path}"
            try:
                return await self._relay(request, url, body, headers)
            except aiohttp.ClientConnectorError as e:
                log.warning("decode engine %s unreachable (%s); trying the next", url, e)
        return _error(502, "no decode engine could be reached")

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | web.Response | None:
        """The prefill engine's transfer parameters; its error answer; or None if it cannot
        be reached (the decode engine then computes the prompt)."""
        asked = {**body, "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}
        for key in ("max_completion_tokens", "min_tokens", "stream_options"):
            asked.pop(key, None)
        if "max_completion_tokens" in body:
            asked["max_completion_tokens"] = 1
        url = f"{next(self.next_prefill)}{path}"
        try:
            async with self.session.post(url, json=asked, headers=headers) as r:
                answer = await r.read()
                if r.status != 200:
                    return web.Response(body=answer, status=r.status,
                                        content_type="application/json")
                return json.loads(answer).get("kv_transfer_params")
        except aiohttp.ClientError as e:
            log.warning("prefill engine %s unreachable (%s); the decode engine computes it",
                        url, e)
            return None

    async def _relay(self, request: web.Request, url: str, body: dict | None,
                     headers: dict, method: str = "POST") -> web.StreamResponse:
        """The engine's answer as it comes (an event stream stays one). Raises
        ClientConnectorError when the engine cannot be reached (nothing was sent)."""
        try:
            async with self.session.request(method, url, json=body, headers=headers) as r:
                response = web.StreamResponse(status=r.status, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
                await response.prepare(request)
                async for chunk in r.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientConnectorError:
            raise
        except aiohttp.ClientError as e:
            return _error(502, f"engine {url} failed: {e}")

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._relay(request, f"{self.decode[0]}{request.path}", None,
                                     _passed_headers(request), method="GET")
        except aiohttp.ClientConnectorError as e:
            return _error(502, f"decode engine unreachable: {e}")

    async def health(self, request: web.Request) -> web.Response:
        down = []
        for url in self.prefill + self.decode:
            try:
                async with self.session.get(f"{url}/health") as r:
                    if r.status != 200:
                        down.append(url)
            except aiohttp.ClientError:
                down.append(url)
        return web.json_response({"down": down}, status=503 if down else 200)


def _passed_headers(request: web.Request) -> dict:
    return {h: request.headers[h] for h in _PASSED if h in request.headers}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError"
                                        if status == 400 else "BadGatewayError",
                                        "param": None, "code": status}}, status=status)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s router %(levelname)s %(message)s")
    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    web.run_app(Router(*strip).app(), host=getattr(args, "host", "127.0.0.1"),
                port=getattr(args, "port", 8000), print=None)
    return 0
