"""What both `pagewire router` modes share: relaying a request to an engine and passing its
answer back as it comes, the headers engines see, and the router's own error answers (the
OpenAI error shape). aiohttp only, no torch."""
from __future__ import annotations

import json

import aiohttp
from aiohttp import web

ROUTES = ("/v1/completions", "/v1/chat/completions")
_PASSED = ("Authorization", "X-Request-Id")     # request headers the engines see too


_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive",
                  "accept-encoding", "date", "server"})      # per connection: never relayed


async def relay(session: aiohttp.ClientSession, request: web.Request, url: str,
                body: dict | bytes | None, headers: dict,
                method: str = "POST") -> web.StreamResponse:
    """The engine's answer as it comes (an event stream stays one), with its headers. `body`:
    JSON to send, or the client's bytes as they came. Raises ClientConnectorError when the
    engine cannot be reached (nothing was sent)."""
    sent = {"data": body or None} if isinstance(body, bytes) else {"json": body}
    try:
        async with session.request(method, url, headers=headers, **sent) as r:
            response = web.StreamResponse(status=r.status, headers=end_to_end(r.headers))
            await response.prepare(request)
            async for chunk in r.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientConnectorError:
        raise
    except aiohttp.ClientError as e:
        return error(502, f"engine {url} failed: {e}")


async def down_engines(session: aiohttp.ClientSession, urls: list[str]) -> list[str]:
    """The engines whose /health does not answer 200."""
    down = []
    for url in urls:
        try:
            async with session.get(f"{url}/health") as r:
                if r.status != 200:
                    down.append(url)
        except aiohttp.ClientError:
            down.append(url)
    return down


def end_to_end(headers) -> dict:
    """The headers that go on to the other side (not the connection's own)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


def passed_headers(request: web.Request) -> dict:
    return {h: request.headers[h] for h in _PASSED if h in request.headers}


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError"
                                        if status == 400 else "BadGatewayError",
                                        "param": None, "code": status}}, status=status)


async def json_body(request: web.Request) -> dict | web.Response:
    """The request's JSON object, or the 400 answer saying why not."""
    try:
        body = json.loads(await request.read())
    except ValueError:
        return error(400, "the body is not JSON")
    if not isinstance(body, dict):
        return error(400, "the body must be a JSON object")
    return body
