"""The gateway's HTTP side: aiohttp routes over the engine's message pipeline.

A request becomes one TokenizeRequest per choice (prompts x n), each with its own sub-request
id "<id>-<index>". Their replies (RequestFailed from a tokenizer, TextDeltas from the
detokenizer) arrive on the gateway's inbox and are routed by id to the HTTP request's queue.
Whatever way a handler ends (finished, failed, client gone), choices not yet finished are
aborted at the scheduler, so no request outlives its client.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from pagewire.wire.channels import AsyncPullChannel, PushChannel
from pagewire.wire.to_gateway import GatewayInbox, RequestFailed, TextDelta, TextDeltas
from pagewire.wire.to_scheduler import Abort
from pagewire.wire.to_tokenizer import TokenizeRequest

from .protocol import (ApiError, ChatBody, CompletionBody, Formatter, chat_messages,
                       completion_prompts, decode_body, to_sampling, usage)

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 2**20
_json = msgspec.json.Encoder()


class Gateway:
    def __init__(self, config, address):
        self.config = config
        self.model_name = config.served_model_name
        self.created = int(time.time())
        ctx, actx = zmq.Context(), zmq.asyncio.Context()
        self.inbox = AsyncPullChannel(actx, address("gateway"), GatewayInbox)
        self.tokenizers = PushChannel(ctx, [address(f"tokenizer-{i}")
                                            for i in range(config.num_tokenizers)])
        self.scheduler = PushChannel(ctx, address("scheduler"))
        self.routes: dict[str, asyncio.Queue] = {}     # sub-request id -> its request's queue
        self.in_flight = 0
        self.draining = False
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self.errors])
        self.app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions)])

    async def pump(self) -> None:
        """Route every inbox message to the queue of the HTTP request it belongs to."""
        while True:
            msg = await self.inbox.recv()
            items = msg.deltas if isinstance(msg, TextDeltas) else [msg]
            for item in items:
                queue = self.routes.get(item.req_id)
                if queue is not None:
                    queue.put_nowait(item)

    @web.middleware
    async def errors(self, request: web.Request, handler):
        try:
            response = await handler(request)
        except ApiError as e:
            response = web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge:
            e = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
            response = web.json_response(e.body(), status=413)
        except web.HTTPException as e:
            err = ApiError(e.status, e.reason or "error", error_type=e.reason)
            response = web.json_response(err.body(), status=e.status)
        if "X-Request-Id" in request.headers and not response.prepared:
            response.headers["X-Request-Id"] = request.headers["X-Request-Id"]
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if not self.draining else "draining"},
                                 status=503 if self.draining else 200)

    async def models(self, request: web.Request) -> web.Response:
        entry = {"id": self.model_name, "object": "model", "created": self.created,
                 "owned_by": "pagewire", "root": self.config.model_info.path, "parent": None,
                 "max_model_len": self.config.max_model_len}
        return web.json_response({"object": "list", "data": [entry]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), CompletionBody)
        self.check_model(body.model)
        sampling = to_sampling(body, 16 if body.max_tokens is None else body.max_tokens)
        if body.echo:
            raise ApiError(400, "`echo` is not supported yet", "echo")
        subs = [TokenizeRequest(req_id="", arrival_time=time.time(), sampling=sampling,
                                prompt=p.get("prompt"), prompt_token_ids=p.get("prompt_token_ids"))
                for p in completion_prompts(body)]
        fmt = Formatter(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        return await self.serve(request, body, fmt, subs)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), ChatBody)
        self.check_model(body.model)
        sampling = to_sampling(body, body.max_completion_tokens or body.max_tokens)
        sub = TokenizeRequest(req_id="", arrival_time=time.time(), sampling=sampling,
                              messages=chat_messages(body),
                              add_generation_prompt=body.add_generation_prompt,
                              continue_final_message=body.continue_final_message)
        fmt = Formatter(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        return await self.serve(request, body, fmt, [sub])

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model",
                           "NotFoundError")
        if self.draining:
            raise ApiError(503, "the server is shutting down")

    async def serve(self, request: web.Request, body, fmt: Formatter,
                    prompts: list[TokenizeRequest]) -> web.StreamResponse:
        """Fan the prompts out n times each, run them, answer in one response or a stream."""
        choices = _fan_out(prompts, body.n, fmt.id)
        queue: asyncio.Queue = asyncio.Queue()
        open_ids = {c.req_id for c in choices}
        for c in choices:
            self.routes[c.req_id] = queue
        self.in_flight += 1
        try:
            for c in choices:
                self.tokenizers.send(c)
            first = await _first_replies(queue, len(choices), open_ids)
            run = _Choices(queue, first, open_ids, len(prompts), body.n)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await self.stream(request, fmt, run, include_usage)
            return await self.collect(fmt, run)
        finally:
            self.in_flight -= 1
            for c in choices:
                self.routes.pop(c.req_id, None)
            if open_ids:
                self.scheduler.send(Abort(sorted(open_ids)))

    async def collect(self, fmt: Formatter, run: "_Choices") -> web.Response:
        texts, reasons = {}, {}
        async for index, delta in run:
            if delta.finish_reason == "error":
                raise ApiError(500, delta.error or "generation failed")
            texts[index] = texts.get(index, "") + delta.text
            if delta.finish_reason:
                reasons[index] = delta.finish_reason
        return web.json_response(fmt.full(texts, reasons, run.usage()), dumps=_dumps)

    async def stream(self, request: web.Request, fmt: Formatter, run: "_Choices",
                     include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        if "X-Request-Id" in request.headers:
            response.headers["X-Request-Id"] = request.headers["X-Request-Id"]
        await response.prepare(request)
        if fmt.chat:
            for index in range(run.num_choices):
                await _send_event(response, fmt.chunk(index, None, None, role=True))
        async for index, delta in run:
            if delta.finish_reason == "error":
                await _send_event(response, ApiError(500, delta.error or "generation failed").body())
                break
            if delta.text or (delta.finish_reason and not fmt.chat):
                await _send_event(response, fmt.chunk(index, delta.text, None if fmt.chat
                                                      else delta.finish_reason))
            if delta.finish_reason and fmt.chat:
                await _send_event(response, fmt.chunk(index, None, delta.finish_reason))
        else:
            if include_usage:
                await _send_event(response, fmt.usage_chunk(run.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; wait up to `timeout` seconds for in-flight ones to finish."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _fan_out(prompts: list[TokenizeRequest], n: int, base_id: str) -> list[TokenizeRequest]:
    """Choice i*n + j is prompt i's j-th sample; seeded requests get seed + j so the n samples
    differ yet stay reproducible."""
    choices = []
    for i, p in enumerate(prompts):
        for j in range(n):
            s = p.sampling
            if j and s.seed is not None:
                s = msgspec.structs.replace(s, seed=(s.seed + j) % 2**63)
            choices.append(msgspec.structs.replace(p, req_id=f"{base_id}-{i * n + j}", sampling=s))
    return choices


async def _first_replies(queue: asyncio.Queue, count: int, open_ids: set[str]) -> list:
    """Wait until every choice has answered once; a refusal (bad prompt, too long) becomes
    the HTTP error before any response byte is sent."""
    seen, replies = set(), []
    while len(seen) < count:
        msg = await queue.get()
        seen.add(msg.req_id)
        if isinstance(msg, RequestFailed):
            open_ids.discard(msg.req_id)
            raise ApiError(msg.status, msg.message, msg.param, msg.error_type)
        replies.append(msg)
    return replies


class _Choices:
    """Async iterator over (choice index, TextDelta) until every choice has finished; keeps
    token counts for usage. Removes finished ids from `open_ids`."""

    def __init__(self, queue, first: list[TextDelta], open_ids: set[str], num_prompts: int, n: int):
        self.queue, self.buffer, self.open_ids = queue, list(first), open_ids
        self.num_choices = num_prompts * n
        self.n = n
        self.prompt_tokens: dict[int, int] = {}
        self.output_tokens: dict[int, int] = {}

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, TextDelta]:
        if not self.open_ids and not self.buffer:
            raise StopAsyncIteration
        delta = self.buffer.pop(0) if self.buffer else await self.queue.get()
        index = int(delta.req_id.rsplit("-", 1)[1])
        self.prompt_tokens[index // self.n] = delta.num_prompt_tokens
        self.output_tokens[index] = delta.num_output_tokens
        if delta.finish_reason:
            self.open_ids.discard(delta.req_id)
        return index, delta

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens.values()), sum(self.output_tokens.values()))


def _dumps(obj) -> str:
    return _json.encode(obj).decode()


async def _send_event(response: web.StreamResponse, obj: dict) -> None:
    await response.write(b"data: " + _json.encode(obj) + b"\n\n")
