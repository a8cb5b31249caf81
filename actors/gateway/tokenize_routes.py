"""/tokenize, /detokenize, /version and /admin/trace: tokenizing is answered by a tokenizer
actor (the gateway loads no tokenizer); /version and the trace switch by the gateway itself."""
from __future__ import annotations

import asyncio
import os
import uuid

import msgspec
from aiohttp import web

import pagewire
from pagewire.wire.to_gateway import RequestFailed
from pagewire.wire.to_tokenizer import DetokenizeOnly, TokenizeOnly
from pagewire.wire.trace import ENABLED_FLAG, set_recording

from .protocol import ApiError, ChatMessageBody, chat_messages, decode_body


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class TraceSwitch(msgspec.Struct, kw_only=True):
    enabled: bool


class TokenizeRoutes:
    def __init__(self, gateway):
        self.gateway = gateway

    def routes(self) -> list:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                web.get("/version", self.version), web.get("/admin/trace", self.trace),
                web.post("/admin/trace", self.trace)]

    async def ask(self, msg):
        """Send to a tokenizer; the reply, or its RequestFailed as an ApiError."""
        queue: asyncio.Queue = asyncio.Queue()
        self.gateway.routes[msg.req_id] = queue
        try:
            self.gateway.tokenizers.send(msg)
            reply = await queue.get()
        finally:
            self.gateway.routes.pop(msg.req_id, None)
        if isinstance(reply, RequestFailed):
            raise ApiError(reply.status, reply.message, reply.param, reply.error_type)
        return reply

    async def tokenize(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), TokenizeBody)
        self.gateway.check_model(body.model, needs_weights=False)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        messages = chat_messages(body) if body.messages is not None else None
        reply = await self.ask(TokenizeOnly(
            req_id=f"tok-{uuid.uuid4().hex}", prompt=body.prompt, messages=messages,
            add_special_tokens=body.add_special_tokens,
            add_generation_prompt=body.add_generation_prompt))
        return web.json_response({
            "count": len(reply.token_ids), "max_model_len": self.gateway.config.model.max_model_len,
            "tokens": reply.token_ids,
            "token_strs": reply.token_strs if body.return_token_strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), DetokenizeBody)
        self.gateway.check_model(body.model, needs_weights=False)
        reply = await self.ask(DetokenizeOnly(f"detok-{uuid.uuid4().hex}", body.tokens))
        return web.json_response({"prompt": reply.text})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": pagewire.__version__})

    async def trace(self, request: web.Request) -> web.Response:
        """Recording on or off at run time (every actor checks the flag file within a second).
        Behind the API key; only for a server started with --trace DIR."""
        trace_dir = self.gateway.config.observability.trace_dir
        if not trace_dir:
            raise ApiError(409, "recording needs a server started with --trace DIR",
                           error_type="ConflictError")
        on = os.path.exists(os.path.join(trace_dir, ENABLED_FLAG))
        if request.method == "POST":
            on = set_recording(trace_dir, decode_body(await request.read(), TraceSwitch).enabled)
        return web.json_response({"recording": on, "directory": trace_dir})
