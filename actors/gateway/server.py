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
from pagewire.wire.kv_transfer import KvTransfer
from pagewire.wire.lora import LoraRef
from pagewire.wire.sampling_params import InvalidParam
from pagewire.wire.to_gateway import (EngineEvent, EngineReady, GatewayInbox, RequestFailed, SchedulerStats,
                                      TextDelta, TextDeltas)
from pagewire.wire.to_scheduler import Abort
from pagewire.wire.to_tokenizer import TokenizeRequest

from ..disagg import answer_params, request_transfer
from . import harmony
from .api_keys import ApiKeys
from .metrics import GatewayMetrics
from .media import MediaFetcher
from .protocol import (ApiError, ChatBody, CompletionBody, chat_images, chat_logprobs,
                       chat_messages, check_count, completion_prompts, decode_body,
                       template_kwargs, to_sampling)
from .batch_routes import BatchRoutes
from .doors import Door
from .request_run import RequestRun
from .responses_api import ResponsesRoutes
from .anthropic_api import AnthropicRoutes
from .responses import Formatter
from .tools import plan_tools
from .lora_routes import LoraRoutes
from .sleep_routes import SleepRoutes
from .ollama_routes import OllamaRoutes
from .pooling_routes import PoolingRoutes
from .stream_input import StreamInputRoutes
from .tokenize_routes import TokenizeRoutes
from .tokenizer_pool import TokenizerPool

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 2**20
ENGINE_SILENT_AFTER = 10.0    # seconds without a scheduler heartbeat: the engine is down
STEP_STALLED_AFTER = 60.0     # seconds one step may run before the engine counts as hung
_json = msgspec.json.Encoder()


class Gateway:
    def __init__(self, config, address, tracer=None):
        self.config = config
        self.model_name = config.model.served_model_name
        self.created = int(time.time())
        self.tracer = tracer
        ctx, actx = zmq.Context(), zmq.asyncio.Context()
        self.inbox = AsyncPullChannel(actx, address("gateway"), GatewayInbox, tracer=tracer,
                                      name="gateway")
        self.tokenizers = TokenizerPool(ctx, address, config.server.num_tokenizers, tracer)
        self.scheduler = PushChannel(ctx, address("scheduler"), tracer=tracer, name="scheduler")
        self.routes: dict[str, asyncio.Queue] = {}     # sub-request id -> its request's queue
        self.in_flight = 0
        self.draining = False
        self.heard_from_engine = time.monotonic()   # and again at EngineReady
        self.engine_down: str | None = None         # why the engine core is restarting
        self.engine_ready = asyncio.Event()         # the supervisor's EngineReady came
        self.step_running_for = 0.0
        spec = config.speculative_config
        self.metrics = GatewayMetrics(self.model_name, config.model.max_model_len,
                                      config.scheduler.max_num_batched_tokens,
                                      spec.num_speculative_tokens if spec else 1,
                                      config.lora.max_loras if config.lora.enable_lora else None)
        if config.device.backend:       # else it comes with EngineReady
            self.metrics.set_backend(config.device.backend, config.model.dtype)
        self.metrics.set_cache_config(config)
        # (path prefix, shaper): an API's errors in its own shape (doors.py Door.error_body)
        self.error_shapes: list[tuple[str, object]] = []
        self.media = MediaFetcher(config.server)
        self.keys = ApiKeys(config.server)          # API keys and tenants' salts (api_keys.py)
        self.loras = LoraRoutes(self)
        self.sleep = SleepRoutes(self)
        self.stream_input = StreamInputRoutes(self, self.tokenizers)
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self.errors])
        self.app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            *TokenizeRoutes(self).routes(), *self.loras.routes(),
            *ResponsesRoutes(self).routes(), *AnthropicRoutes(self).routes(),
            *OllamaRoutes(self).routes(), *BatchRoutes(self).routes(),
            *self.stream_input.routes(), *PoolingRoutes(self).routes(), *self.sleep.routes()])
        self.app.router.add_get("/metrics", self.metrics.handler)

    async def pump(self) -> None:
        """Route every inbox message to the queue of the HTTP request it belongs to."""
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, EngineEvent):
                self.on_engine_event(msg)
                continue
            if isinstance(msg, EngineReady):
                self.on_engine_ready(msg)
                continue
            if isinstance(msg, SchedulerStats):
                self.metrics.on_scheduler_stats(msg)
                self.heard_from_engine, self.step_running_for = time.monotonic(), msg.step_running_for
                self.tokenizers.forget_gone(self.routes.__contains__)
                continue
            items = msg.deltas if isinstance(msg, TextDeltas) else [msg]
            for item in items:
                key = item.seq_id if isinstance(item, TextDelta) else item.req_id
                self.tokenizers.answered(item.seq_id.req if isinstance(item, TextDelta) else key)
                queue = self.routes.get(key)
                if queue is not None:
                    queue.put_nowait(item)
                    if isinstance(item, TextDelta):   # timed on arrival, not when consumed
                        self.metrics.on_tokens(item)

    @web.middleware
    async def errors(self, request: web.Request, handler):
        try:
            if self.keys.guards(request.path):
                self.keys.check(request)
            response = await handler(request)
        except ApiError as e:
            response = self.error_response(request, e)
        except InvalidParam as e:
            response = self.error_response(request, ApiError(400, str(e), e.param))
        except web.HTTPRequestEntityTooLarge:
            response = self.error_response(
                request, ApiError(413, f"request body over {MAX_BODY_BYTES} bytes"))
        except web.HTTPException as e:
            response = self.error_response(
                request, ApiError(e.status, e.reason or "error", error_type=e.reason))
        if "X-Request-Id" in request.headers and not response.prepared:
            response.headers["X-Request-Id"] = request.headers["X-Request-Id"]
        return response

    def error_response(self, request: web.Request, error: ApiError) -> web.Response:
        """`error` in the shape of the API whose route was asked (OpenAI's by default)."""
        shape = next((fn for prefix, fn in self.error_shapes
                      if request.path.startswith(prefix)), Door.error_body)
        return web.json_response(shape(error), status=error.status)

    def own_url(self) -> str:
        """This gateway's address, as a batch reaches its routes (batch_routes.py)."""
        host = self.config.server.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:" \
            f"{self.config.server.port}"

    async def health(self, request: web.Request) -> web.Response:
        status = self.engine_status()
        return web.json_response({"status": status}, status=200 if status == "ok" else 503)

    def on_engine_ready(self, msg: EngineReady) -> None:
        """Every other actor is Ready: the HTTP port may open (actor.py). Idempotent."""
        if not self.engine_ready.is_set():
            self.metrics.set_backend(msg.backend or "unknown", self.config.model.dtype)
            self.heard_from_engine = time.monotonic()
            self.engine_ready.set()

    def on_engine_event(self, event: EngineEvent) -> None:
        """The supervisor restarts part of the engine. The core ("down"): requests in flight
        fail with a 503, and new ones until "up". A tokenizer ("lost"): what it held is resent
        (tokenizer_pool.py). A detokenizer: nothing (the scheduler rebuilds the new one)."""
        log.warning("engine %s: %s", event.status, event.reason)
        self.fail(self.tokenizers.on_event(event, self.routes.__contains__), event.reason)
        if event.status == "up":
            self.engine_down, self.heard_from_engine = None, time.monotonic()
            self.sleep.engine_restarted()
        elif event.status == "down":
            self.engine_down = event.reason
            self.fail(list(self.routes), event.reason)

    def fail(self, route_ids: list, reason: str) -> None:
        failure = f"the engine restarted ({reason}); retry the request"
        for rid in (r for r in route_ids if r in self.routes):
            self.routes[rid].put_nowait(RequestFailed(req_id=rid, status=503, message=failure,
                                                      error_type="ServiceUnavailableError"))

    def engine_status(self) -> str:
        """ok, draining, or why the engine cannot serve: the scheduler's heartbeat stopped, or
        one step has run far longer than any step should (a hung executor)."""
        if self.draining:
            return "draining"
        if self.engine_down:
            return f"engine restarting: {self.engine_down}"
        if time.monotonic() - self.heard_from_engine > ENGINE_SILENT_AFTER:
            return "engine not responding"
        if self.step_running_for > STEP_STALLED_AFTER:
            return f"engine step stalled for {self.step_running_for:.0f}s"
        return "ok"

    async def models(self, request: web.Request) -> web.Response:
        entry = {"id": self.model_name, "object": "model", "created": self.created,
                 "owned_by": "pagewire", "root": self.config.model.model_info.path, "parent": None,
                 "max_model_len": self.config.model.max_model_len}
        return web.json_response({"object": "list",
                                  "data": [entry, *self.loras.model_entries(self.created)]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve_completion(request, decode_body(await request.read(),
                                                                CompletionBody))

    async def serve_completion(self, request: web.Request, body: CompletionBody,
                               door: type[Door] = Door,
                               default_max_tokens: int | None = 16) -> web.StreamResponse:
        """A completion request, whichever API's route translated it, answered through
        `door`'s shapes. Without max_tokens it generates default_max_tokens (OpenAI's 16;
        None: up to the context)."""
        lora = self.check_model(body.model)
        self.check_generates()
        # echo with logprobs reports the prompt's tokens too: their logprobs are computed.
        prompt_lps = body.prompt_logprobs if body.prompt_logprobs is not None or not body.echo \
            else body.logprobs
        sampling = to_sampling(body, default_max_tokens if body.max_tokens is None
                               else body.max_tokens, body.logprobs, prompt_lps)
        prompts = completion_prompts(body)
        session = self.stream_input.check(body, prompts) if body.stream_input else None
        transfer = self.kv_transfer(body, sampling, len(prompts))
        subs = [TokenizeRequest(req_id="", arrival_time=time.time(), sampling=sampling,
                                prompt=p.get("prompt"), prompt_token_ids=p.get("prompt_token_ids"),
                                cache_salt=self.keys.salt(request, body), priority=body.priority,
                                echo=body.echo, lora=lora, kv_transfer=transfer)
                for p in prompts]
        fmt = Formatter(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()),
                        lora.name if lora else self.model_name,
                        logprobs=body.logprobs is not None,
                        prompt_logprobs=body.prompt_logprobs is not None, echo=body.echo,
                        token_ids=body.return_tokens_as_token_ids)
        return await self.serve(request, body, fmt, subs, session, door=door)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve_chat(request, decode_body(await request.read(), ChatBody))

    async def serve_chat(self, request: web.Request, body: ChatBody,
                         door: type[Door] = Door) -> web.StreamResponse:
        """A chat request, whichever API's route translated it (doors.py), answered through
        `door`'s shapes."""
        lora = self.check_model(body.model)
        self.check_generates()
        check_count("tools", body.tools)
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.config)
        sampling = to_sampling(body, body.max_completion_tokens or body.max_tokens,
                               chat_logprobs(body), body.prompt_logprobs, tools.constraint)
        sampling = harmony.keep_markers(sampling, self.config.server.reasoning_parser)
        messages = chat_messages(body)
        images = await self.media.fetch_all(chat_images(body))
        sub = TokenizeRequest(req_id="", arrival_time=time.time(), sampling=sampling,
                              messages=messages, images=images, tools=tools.template_tools,
                              add_generation_prompt=body.add_generation_prompt,
                              continue_final_message=body.continue_final_message,
                              cache_salt=self.keys.salt(request, body), priority=body.priority,
                              chat_template_kwargs=template_kwargs(body), lora=lora,
                              kv_transfer=self.kv_transfer(body, sampling, 1))
        fmt = Formatter(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()),
                        lora.name if lora else self.model_name,
                        logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs is not None,
                        token_ids=body.return_tokens_as_token_ids, tools=tools,
                        reasoning_parser=self.config.server.reasoning_parser)
        return await self.serve(request, body, fmt, [sub], door=door)

    def kv_transfer(self, body, sampling, num_prompts: int) -> KvTransfer | None:
        """The request's part in disaggregated prefill/decode (disagg.py), or a 400."""
        try:
            transfer = request_transfer(self.config, body.kv_transfer_params, sampling)
        except ValueError as e:
            raise ApiError(400, str(e), "kv_transfer_params") from None
        if transfer is not None and transfer.remote_decode and num_prompts > 1:
            raise ApiError(400, "do_remote_decode: one prompt a request", "kv_transfer_params")
        return transfer

    def check_model(self, model: str | None, needs_weights: bool = True) -> LoraRef | None:
        """The adapter `model` names (None: the base model); 404 for an unknown model, 503
        while the engine cannot take requests (or, `needs_weights`, while it sleeps)."""
        lora = self.loras.lookup(model)
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if self.engine_down:
            raise ApiError(503, f"the engine is restarting ({self.engine_down})")
        if needs_weights:
            self.sleep.check_awake()
        return lora

    def check_generates(self) -> None:
        """A 400 for a generation request (completions, chat and every door onto them) to a
        model that only pools (--runner pooling; pooling_routes.py serves it)."""
        pooler = self.config.model.model_info.pooler
        if pooler is not None and not pooler.also_generates:
            raise ApiError(400, f"this model runs with --runner pooling (task {pooler.task}): "
                           "it generates nothing; use /v1/embeddings, /pooling, /score, "
                           "/rerank or /classify, or serve a generating model with --runner "
                           "generate", "model")

    async def serve(self, request: web.Request, body, fmt: Formatter,
                    prompts: list[TokenizeRequest], session: str | None = None,
                    door: type[Door] = Door) -> web.StreamResponse:
        """Run the prompts (each generating its n sequences), answer in one response or a
        stream, in `door`'s shapes. `session`: a streamed prompt's name (stream_input.py)."""
        if body.stream and prompts[0].sampling.num_outputs > prompts[0].sampling.n:
            raise ApiError(400, "best_of > n cannot be streamed", "best_of")
        for i, p in enumerate(prompts):
            p.req_id = f"{fmt.id}-{i}"
        if prompts[0].kv_transfer is not None and prompts[0].kv_transfer.remote_decode:
            fmt.kv_transfer_params = answer_params(self.config, prompts[0].req_id)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        answer = door(fmt, include_usage)
        run = RequestRun(prompts)
        for rid in run.route_ids():
            self.routes[rid] = run.queue
        self.in_flight += 1
        self.metrics.on_request_start(list(run.slot), api=answer.name)
        try:
            for p in prompts:
                if session:
                    self.stream_input.open(session, p)
                else:
                    self.tokenizers.send(p)
            await run.first_replies()
            answer.started(run.usage())
            if body.stream:
                return await self.stream(request, fmt, run, answer)
            return await self.collect(fmt, run, answer)
        finally:
            self.in_flight -= 1
            self.metrics.on_request_end(list(run.slot), run.open_ids)
            for rid in run.route_ids():
                self.routes.pop(rid, None)
            if run.open_ids:
                self.scheduler.send(Abort(sorted(run.open_ids)))
            if session:
                self.stream_input.close(session)

    async def collect(self, fmt: Formatter, run: RequestRun, door: Door) -> web.Response:
        async for _ in run:
            pass
        return web.json_response(door.full(fmt.full(run.best_choices(), run.usage())),
                                 dumps=_dumps)

    async def stream(self, request: web.Request, fmt: Formatter, run: RequestRun,
                     door: Door) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": door.content_type,
                                               "Cache-Control": "no-cache"})
        if "X-Request-Id" in request.headers:
            response.headers["X-Request-Id"] = request.headers["X-Request-Id"]
        await response.prepare(request)
        for data in door.opening(run.num_choices):
            await response.write(data)
        try:
            async for index, delta in run:
                for chunk in fmt.chunks(index, delta):
                    for data in door.events(chunk):
                        await response.write(data)
            tail = door.closing(run.usage())
        except ApiError as e:   # the engine failed mid-stream
            tail = door.failed(e)
        for data in tail:
            await response.write(data)
        await response.write_eof()
        return response

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; wait up to `timeout` seconds for in-flight ones to finish."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _dumps(obj) -> str:
    return _json.encode(obj).decode()

