"""Anthropic's Messages API over HTTP with the official anthropic client, on the default
model: text streamed and not (the same greedy answer, the prompt counted as count_tokens
counts it), stop sequences, forced tool use parsing against its schema and answered back,
thinking blocks from the reasoning parser, the key in x-api-key, a disconnect freeing its
blocks, and Anthropic's error shape on hostile bodies."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from pagewire.testing.server import running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}      # the 2.x client has no sampling arguments: sent as extras
WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
               "required": ["city"]}}
KEY = {"x-api-key": "k1"}


@pytest.fixture(scope="module")
def server():
    with running_server(["--max-model-len", "512", "--kv-cache-memory", "64MiB",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--api-key", "k1"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="k1", max_retries=0)


def test_text_streamed_and_not_is_one_answer(client):
    ask = dict(model=MODEL, system="Be brief.", messages=ASK, extra_body=GREEDY)
    client.messages.create(max_tokens=1, **ask)                     # warm the prefix cache
    whole = client.messages.create(max_tokens=10, **ask)
    assert (whole.type, whole.role, whole.model) == ("message", "assistant", MODEL)
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK)
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (counted.input_tokens, 10)
    with client.messages.stream(max_tokens=10, **ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        ("max_tokens", counted.input_tokens, 10)


def test_a_stop_sequence_ends_the_text_and_is_named(client):
    ask = dict(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    text = client.messages.create(**ask).content[0].text
    stop = text.split()[3]                  # a word from inside the greedy answer
    cut = client.messages.create(stop_sequences=[stop, "never said"], **ask)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    with client.messages.stream(stop_sequences=[stop, "never said"], **ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == cut.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_forced_tool_use_parses_against_its_schema(client):
    forced = dict(model=MODEL, max_tokens=60, tools=[WEATHER], extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    whole = client.messages.create(**forced)
    (call,) = whole.content
    assert (call.type, call.name, whole.stop_reason) == ("tool_use", "get_weather", "tool_use")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**forced) as stream:
        pieces = "".join(e.delta.partial_json for e in stream
                         if e.type == "content_block_delta")
        final = stream.get_final_message()
    assert json.loads(pieces) == final.content[0].input == call.input
    # the call and its result answer back in the next turn
    after = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=[
        *forced["messages"], {"role": "assistant", "content": [call.model_dump(
            include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "18C, sunny"}]}])
    assert after.usage.input_tokens > whole.usage.input_tokens and after.content


def test_thinking_blocks_come_from_the_reasoning_parser():
    # deepseek_r1: the output starts inside the reasoning block, so it is all thinking here
    with running_server(["--max-model-len", "256", "--kv-cache-memory", "32MiB",
                         "--reasoning-parser", "deepseek_r1"]) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        ask = dict(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY,
                   thinking={"type": "enabled", "budget_tokens": 1024})
        client.messages.create(**ask)                               # warm the prefix cache
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking
    assert set(deltas) == {"thinking_delta"}
    assert final.content[0].thinking == whole.content[0].thinking


def test_the_key_goes_in_x_api_key_or_as_bearer(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) \
            .messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid or missing API key"}}
    bearer = anthropic.Anthropic(base_url=server.url, auth_token="k1", max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=1, messages=ASK).usage.output_tokens \
        == 1


def test_a_disconnect_mid_stream_frees_its_blocks(server):
    body = {"model": MODEL, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story."}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=KEY,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line == "event: content_block_delta":
                break                                    # one delta, then hang up
    assert server.kv_blocks_freed()


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, body, status, kind", [
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": USER, "bogus": 1}, 400,
     "invalid_request_error"),                                  # unknown field
    ("/v1/messages", {"model": MODEL, "max_tokens": "1", "messages": USER}, 400,
     "invalid_request_error"),                                  # wrong type
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": 5}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "messages": USER}, 400, "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": USER * 5000}, 400,
     "invalid_request_error"),                                  # huge list
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": USER,
                      "stop_sequences": ["s"] * 100}, 400, "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": USER,
                      "tools": [WEATHER] * 200}, 400, "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": USER, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": USER, "tools": [WEATHER],
                      "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": USER,
                      "max_tokens_typo": 1}, 400, "invalid_request_error"),
    ("/v1/messages", {"model": "claude-x", "max_tokens": 1, "messages": USER}, 404,
     "not_found_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 100000, "messages": USER}, 400,
     "invalid_request_error"),                                  # past the context
    ("/v1/messages", {"model": MODEL, "max_tokens": 100000, "messages": USER, "stream": True},
     400, "invalid_request_error"),                             # refused before the stream
    ("/v1/messages", {"model": MODEL, "max_tokens": 0, "messages": USER}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "invalid_request_error"),                                  # a wrong type deep inside
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}] * 300}]}, 400,
     "invalid_request_error"),                                  # too many blocks
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "server_tool_use", "id": "s"}]}]}, 400,
     "invalid_request_error"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": USER, "max_tokens": 1}, 400,
     "invalid_request_error"),
    ("/v1/messages/nothing", {}, 404, "not_found_error"),
])
def test_hostile_bodies_get_anthropic_errors(server, path, body, status, kind):
    code, answer, _ = server.request("POST", path, body, KEY)
    assert code == status and answer["type"] == "error"
    assert answer["error"]["type"] == kind and answer["error"]["message"]
    assert server.healthy()


def test_malformed_json_gets_an_anthropic_error(server):
    code, answer, _ = server.request("POST", "/v1/messages", b"{\"model\": ", KEY)
    assert code == 400 and answer["error"]["type"] == "invalid_request_error"
