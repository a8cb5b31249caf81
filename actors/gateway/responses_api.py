"""POST /v1/responses and its stored responses (GET, DELETE, cancel): OpenAI's Responses API
as a door onto the chat request path (doors.py). responses_items.py translates the request and
shapes the items; this module answers: the whole response, or the typed stream events
(response.created, response.output_item.added, response.output_text.delta, ...,
response.completed), and keeps what `store` asks for.
"""
from __future__ import annotations

import asyncio
import functools
import time

import msgspec
from aiohttp import web

from .doors import Door, chunk_choice, sse
from .protocol import ApiError, decode_body
from .responses_items import (ResponsesBody, ResponseStore, answer_messages, call_item,
                              message_item, new_id, output_items, reasoning_item, text_part,
                              to_chat)


class ResponseRun:
    """One response: what its envelope echoes of the request, and where it is stored."""

    def __init__(self, routes: "ResponsesRoutes", body: ResponsesBody, tenant: str | None,
                 conversation: list, model: str):
        self.routes, self.body, self.tenant = routes, body, tenant
        self.conversation, self.model = conversation, model
        self.id, self.created = new_id("resp"), int(time.time())

    def envelope(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": b.background, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id, "reasoning": b.reasoning,
            "store": b.store, "temperature": b.temperature, "top_p": b.top_p,
            "text": {"format": {"type": "text"}} if b.text is None else _plain(b.text),
            "tool_choice": _plain(b.tool_choice) if b.tool_choice is not None else "auto",
            "tools": [_plain(t) for t in b.tools or []], "truncation": b.truncation or
            "disabled", "usage": usage, "user": b.user, "metadata": b.metadata or {}}

    def finish(self, output: list[dict], finish_reason: str | None, chat_usage: dict) -> dict:
        """The finished response (stored where `store` asks)."""
        status = "incomplete" if finish_reason == "length" else "completed"
        response = self.envelope(status, output, _usage(chat_usage))
        self.keep(response, answer_messages(output))
        return response

    def keep(self, response: dict, answer: list) -> None:
        if self.body.store:
            self.routes.store.put(self.tenant, response, self.conversation + answer)


def _plain(struct) -> object:
    return msgspec.to_builtins(struct)


def _usage(chat: dict) -> dict:
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


class ResponsesDoor(Door):
    """The chat answer as a Response; the chat chunks as the Responses stream's events. One
    output item is open at a time: text, reasoning or a function call's arguments, each
    closed (its .done events) when the next kind starts or the stream ends."""

    name = "responses"

    def __init__(self, fmt, include_usage: bool = False, *, run: ResponseRun):
        super().__init__(fmt, include_usage)
        self.run, self.seq = run, 0
        self.output: list[dict] = []         # items closed so far
        self.open: dict | None = None        # the item being streamed
        self.calls: dict[int, dict] = {}     # a streamed call's index -> its item
        self.finish_reason: str | None = None

    def full(self, answer: dict) -> dict:
        choice = answer["choices"][0]
        items = output_items(choice["message"])
        logprobs = (choice.get("logprobs") or {}).get("content")
        for item in items:
            if item["type"] == "message" and logprobs:
                item["content"][0]["logprobs"] = logprobs
        return self.run.finish(items, choice["finish_reason"], answer["usage"])

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def opening(self, num_choices: int) -> list[bytes]:
        started = self.run.envelope("in_progress", [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def events(self, chunk: dict) -> list[bytes]:
        choice = chunk_choice(chunk)
        if choice is None:
            return []
        delta, out = choice["delta"], []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"], None)
        if delta.get("content"):
            logprobs = (choice.get("logprobs") or {}).get("content")
            out += self._text("message", delta["content"], logprobs)
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return out

    def _text(self, kind: str, text: str, logprobs: list | None) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            self.open = reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning" \
                else message_item(new_id("msg"), "", "in_progress")
            part = self.open["content"][0]
            out.append(self._event("response.output_item.added", output_index=len(self.output),
                                   item={**self.open, "content": []}))
            out.append(self._event("response.content_part.added", item_id=self.open["id"],
                                   output_index=len(self.output), content_index=0, part=part))
        part = self.open["content"][0]
        part["text"] += text
        where = dict(item_id=self.open["id"], output_index=len(self.output), content_index=0)
        if kind == "reasoning":
            return out + [self._event("response.reasoning_text.delta", delta=text, **where)]
        part["logprobs"] += logprobs or []
        return out + [self._event("response.output_text.delta", delta=text,
                                  logprobs=logprobs or [], **where)]

    def _call(self, call: dict) -> list[bytes]:
        out, item = [], self.calls.get(call.get("index", 0))
        if item is None:
            out += self._close()
            function = call.get("function") or {}
            item = self.open = call_item(new_id("fc"), call.get("id") or new_id("call"),
                                         function.get("name", ""), "", "in_progress")
            self.calls[call.get("index", 0)] = item
            out.append(self._event("response.output_item.added", output_index=len(self.output),
                                   item=dict(item)))
        piece = (call.get("function") or {}).get("arguments") or ""
        if piece:
            item["arguments"] += piece
            out.append(self._event("response.function_call_arguments.delta", delta=piece,
                                   item_id=item["id"], output_index=len(self.output)))
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        where = dict(item_id=item["id"], output_index=len(self.output))
        if item["type"] == "function_call":
            out = [self._event("response.function_call_arguments.done", name=item["name"],
                               arguments=item["arguments"], **where)]
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else \
                "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
            out = [self._event(done, content_index=0, text=part["text"], **extra, **where),
                   self._event("response.content_part.done", content_index=0, part=part,
                               **where)]
        out.append(self._event("response.output_item.done", output_index=len(self.output),
                               item=item))
        self.output.append(item)
        return out

    def closing(self, usage: dict) -> list[bytes]:
        out = self._close()
        response = self.run.finish(self.output, self.finish_reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else \
            "response.completed"
        return out + [self._event(kind, response=response)]

    def failed(self, error: ApiError) -> list[bytes]:
        response = self.run.envelope("failed", self.output, error={
            "code": "server_error", "message": error.message})
        self.run.keep(response, [])
        return [self._event("error", code=error.error_type, message=error.message,
                            param=error.param),
                self._event("response.failed", response=response)]


class ResponsesRoutes:
    """The routes, the store and the background responses still running."""

    def __init__(self, gateway):
        self.gw = gateway
        server = gateway.config.server
        self.store = ResponseStore(server.responses_store_entries, server.responses_store_bytes)
        self.background: dict[tuple, asyncio.Task] = {}

    def routes(self) -> list:
        return [web.post("/v1/responses", self.create),
                web.get("/v1/responses/{id}", self.retrieve),
                web.delete("/v1/responses/{id}", self.delete),
                web.post("/v1/responses/{id}/cancel", self.cancel)]

    def tenant(self, request: web.Request) -> str | None:
        return self.gw.keys.check(request)

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), ResponsesBody)
        tenant = self.tenant(request)
        earlier = []
        if body.previous_response_id:
            previous = self.store.get(tenant, body.previous_response_id)
            if previous is None:
                raise ApiError(404, f"previous response {body.previous_response_id!r} not found",
                               "previous_response_id")
            earlier = previous.conversation
        chat = to_chat(body, earlier)
        lora = self.gw.loras.lookup(body.model)
        self.gw.check_generates()          # a 400 now, not a queued response that fails
        run = ResponseRun(self, body, tenant, chat.messages[1 if body.instructions else 0:],
                          lora.name if lora else self.gw.model_name)
        door = functools.partial(ResponsesDoor, run=run)
        if not body.background:
            return await self.gw.serve_chat(request, chat, door=door)
        queued = run.envelope("queued", [])
        run.keep(queued, [])
        task = asyncio.create_task(self._in_background(request, chat, door, run))
        self.background[(tenant, run.id)] = (task, run)
        task.add_done_callback(lambda _: self.background.pop((tenant, run.id), None))
        return web.json_response(queued)

    async def _in_background(self, request, chat, door, run: ResponseRun) -> None:
        try:
            await self.gw.serve_chat(request, chat, door=door)
        except ApiError as e:
            run.keep(run.envelope("failed", [], error={"code": e.error_type,
                                                       "message": e.message}), [])
        except asyncio.CancelledError:
            run.keep(run.envelope("cancelled", []), [])
            raise

    def _stored(self, request: web.Request):
        found = self.store.get(self.tenant(request), request.match_info["id"])
        if found is None:
            raise ApiError(404, f"response {request.match_info['id']!r} not found", "id")
        return found

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(self._stored(request).response)

    async def delete(self, request: web.Request) -> web.Response:
        self._stored(request)
        key = (self.tenant(request), request.match_info["id"])
        if key in self.background:
            self.background[key][0].cancel()
        self.store.pop(*key)
        return web.json_response({"id": key[1], "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        stored = self._stored(request)
        if not stored.response["background"]:
            raise ApiError(400, "only background responses can be cancelled", "id")
        key = (self.tenant(request), request.match_info["id"])
        task, run = self.background.get(key, (None, None))
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            run.keep(run.envelope("cancelled", []), [])   # also where it had not yet started
        return web.json_response(self._stored(request).response)
