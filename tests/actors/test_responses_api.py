"""The Responses API's translations without a server (gateway/responses_items.py,
responses_api.py): input items into chat messages, chat chunks into the typed stream events
(reasoning, text and a call each their own item), and the store's bounds."""
from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from pagewire.gateway.protocol import ApiError
from pagewire.gateway.responses_api import ResponseRun, ResponsesDoor
from pagewire.gateway.responses_items import (ResponsesBody, ResponseStore, input_messages,
                                              to_chat)


def body(**fields) -> ResponsesBody:
    return msgspec.convert({"input": "hi", **fields}, ResponsesBody)


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Weather "},
                          {"type": "input_text", "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"a\":1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    got = [(m.role, m.content, [c.id for c in m.tool_calls or []], m.tool_call_id)
           for m in input_messages(body(input=items))]
    assert got == [("system", "Be brief.", [], None), ("user", "Weather in Paris?", [], None),
                   ("assistant", None, ["c1", "c2"], None), ("tool", "sunny", [], "c1")]


def test_the_chat_request_carries_instructions_tools_and_format():
    chat = to_chat(body(instructions="Be brief.", max_output_tokens=7, top_logprobs=2,
                        tools=[{"type": "function", "name": "w", "parameters": {}}],
                        tool_choice={"type": "function", "name": "w"},
                        text={"format": {"type": "json_schema", "name": "s",
                                         "schema": {"type": "object"}}}), [])
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."),
                                                           ("user", "hi")]
    assert (chat.max_completion_tokens, chat.logprobs, chat.top_logprobs) == (7, True, 2)
    assert chat.tools[0].function.name == "w" and chat.tool_choice.function.name == "w"
    assert chat.response_format.json_schema.schema == {"type": "object"}
    with pytest.raises(ApiError, match="background"):
        to_chat(body(background=True, store=False), [])


def chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": None}]}


def test_stream_events_open_and_close_one_item_at_a_time():
    store = ResponseStore(10, 2**20)
    run = ResponseRun(SimpleNamespace(store=store), body(), None, [], "m")
    door = ResponsesDoor(None, run=run)
    frames = door.opening(1)
    for c in [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Hm"}),
              chunk({"reasoning_content": "m."}), chunk({"content": "Sunny"}),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "w", "arguments": "{\"c"}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\":1}"}}]}),
              chunk({}, "tool_calls")]:
        frames += door.events(c)
    frames += door.closing({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    events = [json.loads(f.split(b"data: ", 1)[1]) for f in frames]
    assert all(f.startswith(b"event: " + e["type"].encode() + b"\n")
               for f, e in zip(frames, events))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [(i["type"], i.get("arguments")) for i in final["output"]] == [
        ("reasoning", None), ("message", None), ("function_call", "{\"c\":1}")]
    assert final["output"][0]["content"][0]["text"] == "Hmm."
    assert final["usage"]["total_tokens"] == 8
    kept = store.get(None, run.id).conversation       # the answer, for a later turn
    assert [(m.role, m.content, m.tool_calls[0].function.arguments) for m in kept] == [
        ("assistant", "Sunny", "{\"c\":1}")]


def test_the_store_drops_the_least_recently_used_past_either_bound():
    store = ResponseStore(2, 2**20)
    for name in "abc":
        if name == "c":
            store.get(None, "a")                      # a used: b is the oldest
        store.put(None, {"id": name}, [])
    assert [k[1] for k in store.entries] == ["a", "c"]
    small = ResponseStore(100, 40)
    small.put(None, {"id": "x", "pad": "y" * 10}, [])
    small.put(None, {"id": "z", "pad": "y" * 10}, [])
    assert [k[1] for k in small.entries] == ["z"] and small.nbytes <= 40
    small.put("k", {"id": "huge", "pad": "y" * 100}, [])   # over the whole bound: not kept
    assert small.get("k", "huge") is None and small.get(None, "z") is not None


def test_input_image_parts_become_chat_image_parts_in_place():
    (message,) = input_messages(body(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is "},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"},
        {"type": "input_text", "text": "?"}]}]))
    assert [(p.type, p.text or p.image_url.url) for p in message.content] == [
        ("text", "What is "), ("image_url", "data:image/png;base64,AAAA"), ("text", "?")]
