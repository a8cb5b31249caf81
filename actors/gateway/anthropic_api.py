"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a door onto
the chat request path (doors.py). anthropic.py translates the request; this module answers:
the whole message, or the stream's named events (message_start, content_block_start /
_delta / _stop per block, message_delta with the stop reason and usage, message_stop), and
the prompt's token count.

Stop sequences: the chat request keeps the matched stop string in its text
(include_stop_str_in_output) so the door can tell which one ended it (stop_reason
"stop_sequence", `stop_sequence`) and cut it, as Anthropic does. While streaming, text that may
still be the start of a stop sequence is held back until the next delta decides.
"""
from __future__ import annotations

import functools
import json
import uuid

from aiohttp import web

from pagewire.wire.to_tokenizer import TokenizeOnly

from .anthropic import CountTokensBody, MessagesBody, error_body, to_chat
from .doors import Door, chunk_choice, sse
from .protocol import ApiError, chat_messages, check_count, decode_body, template_kwargs
from .tokenize_routes import TokenizeRoutes
from .tools import plan_tools

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason, "end_turn")


def cut_stop(text: str, stops: list[str], finish_reason: str | None) -> tuple[str, str | None]:
    """(text without the stop sequence that ended it, that sequence), or (text, None)."""
    if finish_reason == "stop":
        for stop in sorted(stops, key=len, reverse=True):
            if stop and text.endswith(stop):
                return text[:-len(stop)], stop
    return text, None


def held_from(text: str, stops: list[str]) -> int:
    """Where the longest end of `text` that begins some stop sequence starts (len(text): none)."""
    longest = max((len(s) for s in stops), default=0)
    for start in range(max(0, len(text) - longest), len(text)):
        if any(s.startswith(text[start:]) for s in stops):
            return start
    return len(text)


def tool_use(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": parsed}


class AnthropicDoor(Door):
    """The chat answer as an Anthropic message; the chat chunks as its stream's events. One
    content block is open at a time (thinking, text, or one tool call's input), closed when
    the next kind starts or the stream ends."""

    name = "anthropic"
    error_body = staticmethod(error_body)

    def __init__(self, fmt, include_usage: bool = False, *, stops: list[str] = ()):
        super().__init__(fmt, include_usage)
        self.stops = [s for s in stops if s]
        self.id = "msg_" + fmt.id.removeprefix("chatcmpl-") if fmt else "msg_"
        self.input_tokens = 0
        self.num_blocks = 0
        self.open: str | tuple | None = None    # "thinking", "text", ("tool", index)
        self.held = ""                          # text that may begin a stop sequence
        self.finish_reason: str | None = None

    def message(self, content: list, finish_reason: str | None, stop_sequence: str | None,
                usage: dict | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.fmt.model,
                "content": content,
                "stop_reason": finish_reason and stop_reason(finish_reason, stop_sequence),
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": usage["prompt_tokens"] if usage else self.input_tokens,
                          "output_tokens": usage["completion_tokens"] if usage else 0}}

    def full(self, answer: dict) -> dict:
        choice = answer["choices"][0]
        msg, reason = choice["message"], choice["finish_reason"]
        text, stop = cut_stop(msg.get("content") or "", self.stops, reason)
        content = [{"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""}] \
            if msg.get("reasoning_content") else []
        content += [{"type": "text", "text": text}] if text else []
        content += [tool_use(call) for call in msg.get("tool_calls") or []]
        return self.message(content, reason or "stop", stop, answer["usage"])

    # -- streamed ------------------------------------------------------------------------------

    def started(self, usage: dict) -> None:
        self.input_tokens = usage["prompt_tokens"]

    def opening(self, num_choices: int) -> list[bytes]:
        return [sse({"type": "message_start", "message": self.message([], None, None, None)},
                    "message_start")]

    def events(self, chunk: dict) -> list[bytes]:
        choice = chunk_choice(chunk)
        if choice is None:
            return []
        delta, out = choice["delta"], []
        if delta.get("reasoning_content"):
            out += self._flush()
            out += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                               {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._flush() + self._call(call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return out

    def _event(self, kind: str, **fields) -> bytes:
        return sse({"type": kind, **fields}, kind)

    def _delta(self, block: str | tuple, start: dict, delta: dict | None) -> list[bytes]:
        """`delta` into block `block`, opened (with `start`) after closing another."""
        out = []
        if self.open != block:
            out += self._close()
            self.open, self.num_blocks = block, self.num_blocks + 1
            out.append(self._event("content_block_start", index=self.num_blocks - 1,
                                   content_block=start))
        if delta is not None:
            out.append(self._event("content_block_delta", index=self.num_blocks - 1,
                                   delta=delta))
        return out

    def _text(self, text: str) -> list[bytes]:
        text = self.held + text
        cut = held_from(text, self.stops)
        self.held = text[cut:]
        if not text[:cut]:
            return []
        return self._delta("text", {"type": "text", "text": ""},
                           {"type": "text_delta", "text": text[:cut]})

    def _flush(self) -> list[bytes]:
        """Held text, once something else follows it: it was no stop sequence."""
        held, self.held = self.held, ""
        return self._delta("text", {"type": "text", "text": ""},
                           {"type": "text_delta", "text": held}) if held else []

    def _call(self, call: dict) -> list[bytes]:
        function = call.get("function") or {}
        start = {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                 "name": function.get("name", ""), "input": {}}
        piece = function.get("arguments") or ""
        return self._delta(("tool", call.get("index", 0)), start, {
            "type": "input_json_delta", "partial_json": piece} if piece else None)

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.num_blocks - 1)]

    def closing(self, usage: dict) -> list[bytes]:
        self.held, stop = cut_stop(self.held, self.stops, self.finish_reason)
        out = self._flush() + self._close()
        return out + [
            self._event("message_delta", delta={
                "stop_reason": stop_reason(self.finish_reason, stop), "stop_sequence": stop},
                usage={"input_tokens": usage["prompt_tokens"],
                       "output_tokens": usage["completion_tokens"]}),
            self._event("message_stop")]

    def failed(self, error: ApiError) -> list[bytes]:
        return [sse(error_body(error), "error")]


class AnthropicRoutes:
    """The two routes; the door's error shape answers every path under /v1/messages."""

    def __init__(self, gateway):
        self.gw = gateway
        gateway.error_shapes.append(("/v1/messages", error_body))

    def routes(self) -> list:
        return [web.post("/v1/messages", self.messages),
                web.post("/v1/messages/count_tokens", self.count_tokens)]

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), MessagesBody)
        door = functools.partial(AnthropicDoor, stops=body.stop_sequences or [])
        return await self.gw.serve_chat(request, to_chat(body), door=door)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens as /v1/messages would count them (usage.input_tokens): the same
        messages, tools and template switches, through a tokenizer actor; nothing runs."""
        chat = to_chat(decode_body(await request.read(), CountTokensBody))
        self.gw.check_model(chat.model)
        check_count("tools", chat.tools)
        tools = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                           self.gw.config)
        reply = await TokenizeRoutes(self.gw).ask(TokenizeOnly(
            req_id=f"count-{uuid.uuid4().hex}", messages=chat_messages(chat),
            tools=tools.template_tools, chat_template_kwargs=template_kwargs(chat),
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message))
        return web.json_response({"input_tokens": len(reply.token_ids)})
