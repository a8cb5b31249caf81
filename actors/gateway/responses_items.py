"""OpenAI's Responses API at the edge, without I/O: its request body translated into the chat
request the gateway serves (protocol.py ChatBody), the chat answer's message made into output
items, and the bounded store that `previous_response_id` and `GET /v1/responses/{id}` read.

Conversation state: a stored response keeps its whole conversation as chat messages (the
earlier turns, this turn's input, the assistant's answer), so a request naming it continues
from there. `instructions` are not carried over, as OpenAI documents.
"""
from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Any

import msgspec

from .constraints import JsonSchemaFormat, ResponseFormat
from .protocol import (ApiError, ChatBody, ChatMessageBody, ContentPart, FunctionCallBody,
                       ImageUrl, StreamOptions, ToolCallBody, check_count)
from .tools import FunctionDef, NamedFunction, NamedToolChoice, Tool

MAX_INPUT_ITEMS = 4096


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: str
    name: str


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"                  # text, json_object, json_schema
    name: str | None = None
    schema: dict | None = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/responses. Unknown fields are a 400, as OpenAI answers them; the sampling
    extras vLLM accepts (top_k, seed, ...) are declared."""
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: dict | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    priority: int = 0
    cache_salt: str | None = None


class _Part(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: str | None = None            # input_image: a data: or http(s) URL
    detail: str | None = None


class _MessageItem(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[_Part]
    type: str = "message"
    id: str | None = None
    status: str | None = None


class _CallItem(msgspec.Struct, kw_only=True):
    type: str
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _OutputItem(msgspec.Struct, kw_only=True):
    type: str
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


TEXT_PARTS = ("input_text", "output_text", "text")


def _item(raw: dict, index: int):
    """One input item as its struct, or a 400 naming it."""
    kind = raw.get("type", "message")
    shape = {"message": _MessageItem, "function_call": _CallItem,
             "function_call_output": _OutputItem}.get(kind)
    if kind == "reasoning":
        return None                     # earlier reasoning: not sent back to the model
    if shape is None:
        raise ApiError(400, f"input[{index}]: item type {kind!r} is not supported", "input")
    try:
        return msgspec.convert(raw, shape)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"input[{index}]: {e}", "input") from None


def input_messages(body: ResponsesBody) -> list[ChatMessageBody]:
    """The request's input as chat messages (function calls attached to the assistant's
    turn they belong to, their outputs as tool messages)."""
    if isinstance(body.input, str):
        return [ChatMessageBody(role="user", content=body.input)]
    check_count("messages", body.input, "input")
    out: list[ChatMessageBody] = []
    for index, raw in enumerate(body.input):
        item = _item(raw, index)
        if isinstance(item, _MessageItem):
            out.append(ChatMessageBody(role="system" if item.role == "developer" else item.role,
                                       content=_text(item, index)))
        elif isinstance(item, _CallItem):
            call = ToolCallBody(id=item.call_id, function=FunctionCallBody(
                name=item.name, arguments=item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                out.append(ChatMessageBody(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, _OutputItem):
            out.append(ChatMessageBody(role="tool", content=item.output,
                                       tool_call_id=item.call_id))
    return out


def _text(item: _MessageItem, index: int) -> str | list[ContentPart]:
    """A message's content: its text, or its text and image parts in order (a chat message's
    image_url parts)."""
    if isinstance(item.content, str):
        return item.content
    check_count("content", item.content, "input")
    parts = []
    for part in item.content:
        if part.type in TEXT_PARTS:
            parts.append(ContentPart(type="text", text=part.text or ""))
        elif part.type == "input_image" and part.image_url:
            parts.append(ContentPart(type="image_url", image_url=ImageUrl(url=part.image_url)))
        else:
            raise ApiError(400, f"input[{index}]: content part {part.type!r} is not supported "
                           f"(input_text, output_text, input_image with image_url)", "input")
    if all(p.type == "text" for p in parts):
        return "".join(p.text for p in parts)
    return parts


def _tool_choice(choice) -> str | NamedToolChoice | None:
    if isinstance(choice, ToolChoiceFunction):
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return choice


def _response_format(text: TextOptions | None) -> ResponseFormat | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise ApiError(400, "text.format json_schema needs a schema", "text.format")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name or "response", schema=fmt.schema, strict=fmt.strict))
    return ResponseFormat(type=fmt.type)


def to_chat(body: ResponsesBody, earlier: list[ChatMessageBody]) -> ChatBody:
    """The chat request this response runs as: instructions, the earlier conversation (a
    previous response's), then this input."""
    if body.background and (body.stream or not body.store):
        raise ApiError(400, "background responses need store: true and no stream", "background")
    for tool in body.tools or []:
        if tool.type != "function":
            raise ApiError(400, f"tool type {tool.type!r} is not supported", "tools")
    check_count("tools", body.tools)
    system = [ChatMessageBody(role="system", content=body.instructions)] \
        if body.instructions else []
    logprobs = body.top_logprobs is not None or "message.output_text.logprobs" in (
        body.include or [])
    return ChatBody(
        messages=system + earlier + input_messages(body), model=body.model,
        max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        repetition_penalty=body.repetition_penalty, logprobs=logprobs,
        top_logprobs=body.top_logprobs if logprobs else None,
        tools=[Tool(function=FunctionDef(name=t.name, description=t.description,
                                         parameters=t.parameters, strict=t.strict))
               for t in body.tools] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text), stream=body.stream,
        stream_options=StreamOptions(include_usage=True) if body.stream else None,
        user=body.user, priority=body.priority, cache_salt=body.cache_salt)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict) -> list[dict]:
    """The chat answer's message as Responses output items: reasoning, the text, the calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"],
                               call["function"]["arguments"]))
    return items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def answer_messages(items: list[dict]) -> list[ChatMessageBody]:
    """The output items as the assistant's chat turn (what a later response continues)."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [ToolCallBody(id=item["call_id"], function=FunctionCallBody(
        name=item["name"], arguments=item["arguments"]))
        for item in items if item["type"] == "function_call"]
    return [ChatMessageBody(role="assistant", content=text or None, tool_calls=calls or None)]


class Stored(msgspec.Struct):
    response: dict
    conversation: list[ChatMessageBody]
    nbytes: int


class ResponseStore:
    """Responses by (tenant, id), at most `max_entries` and `max_bytes` (their JSON): the
    least recently used go first. A tenant is an API key (None where none is configured):
    one key never reads, chains from or deletes another's."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[tuple, Stored] = OrderedDict()
        self.nbytes = 0

    def put(self, tenant: str | None, response: dict,
            conversation: list[ChatMessageBody]) -> None:
        nbytes = len(json.dumps(response)) + len(msgspec.json.encode(conversation))
        self.pop(tenant, response["id"])
        if nbytes > self.max_bytes:
            return                       # larger than the whole store: not kept
        self.entries[(tenant, response["id"])] = Stored(response, conversation, nbytes)
        self.nbytes += nbytes
        while len(self.entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def get(self, tenant: str | None, response_id: str) -> Stored | None:
        found = self.entries.get((tenant, response_id))
        if found is not None:
            self.entries.move_to_end((tenant, response_id))
        return found

    def pop(self, tenant: str | None, response_id: str) -> Stored | None:
        found = self.entries.pop((tenant, response_id), None)
        if found is not None:
            self.nbytes -= found.nbytes
        return found
