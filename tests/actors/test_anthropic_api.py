"""The Messages API's translations without a server (gateway/anthropic.py, anthropic_api.py):
content blocks into chat messages, tools and choices, the refusals, the error shape, and the
chat answer and chunks back into a message and its stream's events (stop sequences held back
and cut)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from pagewire.gateway.anthropic import MessagesBody, error_body, to_chat
from pagewire.gateway.anthropic_api import AnthropicDoor, held_from
from pagewire.gateway.protocol import ApiError

TOOL = {"name": "w", "input_schema": {"type": "object"}}


def body(**fields) -> MessagesBody:
    return msgspec.convert({"model": "m", "max_tokens": 5,
                            "messages": [{"role": "user", "content": "hi"}], **fields},
                           MessagesBody)


def test_content_blocks_become_chat_messages():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text",
                                                                      "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "t2", "content": "down", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}]
    chat = to_chat(body(system=[{"type": "text", "text": "Be brief."},
                                {"type": "text", "text": "Use tools."}], messages=messages))
    got = [(m.role, m.content, m.tool_call_id) for m in chat.messages]
    assert got == [("system", "Be brief.\nUse tools.", None),
                   ("user", "Weather in Paris?", None), ("assistant", "Let me look.", None),
                   ("tool", "sunny", "t1"), ("tool", "Error: down", "t2"),
                   ("user", "And tomorrow?", None)]
    (call,) = chat.messages[2].tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == \
        ("t1", "w", {"city": "Paris"})
    assert (chat.add_generation_prompt, chat.continue_final_message) == (True, False)


def test_a_final_assistant_turn_is_a_prefill():
    chat = to_chat(body(messages=[{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "Well,"}]))
    assert (chat.add_generation_prompt, chat.continue_final_message) == (False, True)


def test_sampling_tools_and_switches_carry_over():
    chat = to_chat(body(stop_sequences=["END"], temperature=0.5, top_k=3, stream=True,
                        tools=[TOOL], tool_choice={"type": "any",
                                                   "disable_parallel_tool_use": True},
                        thinking={"type": "enabled", "budget_tokens": 2048},
                        output_config={"format": {"type": "json_schema",
                                                  "schema": {"type": "object"}}},
                        metadata={"user_id": "u1"}))
    assert (chat.max_tokens, chat.stop, chat.include_stop_str_in_output) == (5, ["END"], True)
    assert (chat.temperature, chat.top_k, chat.user) == (0.5, 3, "u1")
    assert chat.stream and chat.stream_options.include_usage
    assert (chat.tools[0].function.parameters, chat.tool_choice, chat.parallel_tool_calls) == \
        ({"type": "object"}, "required", False)
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert chat.response_format.json_schema.schema == {"type": "object"}
    named = to_chat(body(tools=[TOOL], tool_choice={"type": "tool", "name": "w"}))
    assert named.tool_choice.function.name == "w" and named.parallel_tool_calls


@pytest.mark.parametrize("fields, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0]: an image's source must be base64 or url"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0]: document content is not supported yet"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "w",
                                                 "input": {}}]}]},
     "messages[0]: a user message cannot hold tool_use blocks"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tool type 'bash_20250124'"),
    ({"tools": [{"name": "w"}]}, "tools[0]: Object missing required field `input_schema`"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice of type tool needs a name"),
    ({"container": "c1"}, "code execution is not supported"),
])
def test_refusals_name_what_is_refused(fields, message):
    with pytest.raises(ApiError, match=message.replace("[", r"\[").replace("]", r"\]")):
        to_chat(body(**fields))


def test_errors_take_anthropics_shape():
    assert error_body(ApiError(400, "bad", "max_tokens")) == {
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "max_tokens: bad"}}
    kinds = [error_body(ApiError(s, "x"))["error"]["type"] for s in (401, 404, 409, 500, 503)]
    assert kinds == ["authentication_error", "not_found_error", "invalid_request_error",
                     "api_error", "overloaded_error"]


FMT = SimpleNamespace(id="chatcmpl-abc", model="m")
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_the_whole_answer_is_a_message():
    door = AnthropicDoor(FMT, stops=["END"])
    message = {"role": "assistant", "content": "Hi END", "reasoning_content": "think",
               "tool_calls": [{"id": "c1", "type": "function",
                               "function": {"name": "w", "arguments": "{\"a\": 1}"}}]}
    got = door.full({"choices": [{"message": message, "finish_reason": "stop"}],
                     "usage": USAGE})
    assert got == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "thinking", "thinking": "think", "signature": ""},
                               {"type": "text", "text": "Hi "},
                               {"type": "tool_use", "id": "c1", "name": "w",
                                "input": {"a": 1}}],
                   "stop_reason": "stop_sequence", "stop_sequence": "END",
                   "usage": {"input_tokens": 7, "output_tokens": 3}}


def chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def events(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for event in raw:
        head, data = event.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stream_events_hold_back_what_may_be_a_stop_sequence():
    door = AnthropicDoor(FMT, stops=["STOP"])
    door.started(USAGE)
    raw = door.opening(1)
    for delta in ({"reasoning_content": "hm"}, {"content": "Hi ST"}, {"content": "ART S"},
                  {"content": "TOP"}):
        raw += door.events(chunk(delta))
    raw += door.events(chunk({}, "stop")) + door.closing(USAGE)
    got = events(raw)
    assert [kind for kind, _ in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert got[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert got[2][1] == {"type": "content_block_delta", "index": 0,
                         "delta": {"type": "thinking_delta", "thinking": "hm"}}
    texts = [data["delta"]["text"] for _, data in got[5:7]]
    assert texts == ["Hi ", "START "] and got[7][1]["index"] == 1
    assert got[8][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    assert got[8][1]["usage"] == {"input_tokens": 7, "output_tokens": 3}


def test_a_streamed_tool_call_is_a_tool_use_block():
    door = AnthropicDoor(FMT)
    raw = door.events(chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                             "function": {"name": "w", "arguments": "{\"a\""}}]}))
    raw += door.events(chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}))
    raw += door.events(chunk({}, "tool_calls")) + door.closing(USAGE)
    got = events(raw)
    assert got[0][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "w",
                                          "input": {}}
    assert "".join(d["delta"]["partial_json"] for k, d in got if k == "content_block_delta") \
        == "{\"a\": 1}"
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_held_from_finds_the_longest_end_that_starts_a_stop():
    assert held_from("abc ST", ["STOP"]) == 4
    assert held_from("abc", ["STOP"]) == 3
    assert held_from("xSTOP", ["STOP", "OPEN"]) == 1
    assert held_from("text", []) == 4


def test_image_blocks_become_chat_image_parts_in_place():
    chat = to_chat(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Look: "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": "AAAA"}},
        {"type": "text", "text": " and "},
        {"type": "image", "source": {"type": "url", "url": "https://x.example/a.png"}}]}]))
    parts = chat.messages[-1].content
    assert [(p.type, p.text or p.image_url.url) for p in parts] == [
        ("text", "Look: "), ("image_url", "data:image/jpeg;base64,AAAA"), ("text", " and "),
        ("image_url", "https://x.example/a.png")]
