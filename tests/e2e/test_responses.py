"""OpenAI's Responses API over HTTP with the official client, on the default model: text
streamed and not (the same greedy answer), conversation state through previous_response_id
(the same prompt and answer as the chat endpoint given the whole conversation), the store's
bound and its isolation between API keys, forced function calls, JSON-schema text format,
background responses and their cancel, a disconnect freeing its blocks, and the 4xx answers to
hostile bodies."""
from __future__ import annotations

import json
import urllib.request

import httpx
import jsonschema
import openai
import pytest

from pagewire.testing.server import openai_client, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = "Name three colors."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
               "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    with running_server(["--max-model-len", "512", "--kv-cache-memory", "64MiB",
                         "--tool-call-parser", "hermes", "--api-key", "k1", "--api-key", "k2",
                         "--responses-store-entries", "4"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, "k1")


def test_text_streamed_and_not_is_one_answer(client):
    client.responses.create(input=ASK, max_output_tokens=1, temperature=0)   # warm the cache
    whole = client.responses.create(input=ASK, max_output_tokens=10, temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"]
    assert whole.usage.output_tokens == 10
    events = list(client.responses.create(input=ASK, max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input=ASK, max_output_tokens=12, temperature=0,
                                    instructions="Answer briefly.")
    second = client.responses.create(input="Three more?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    # the same conversation through chat: the earlier turn and its answer, no instructions
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Three more?"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id


def test_the_store_is_per_key_bounded_and_deletable(server, client):
    other = openai_client(server, "k2")
    mine = client.responses.create(input=ASK, max_output_tokens=2, temperature=0)
    assert client.responses.retrieve(mine.id).output_text == mine.output_text
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)                 # another key's: not found
    with pytest.raises(openai.NotFoundError):
        other.responses.create(input="x", previous_response_id=mine.id, max_output_tokens=1)
    unstored = client.responses.create(input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for _ in range(4):                                    # the store holds 4: `mine` goes
        client.responses.create(input=ASK, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine.id)
    kept = client.responses.create(input=ASK, max_output_tokens=1)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_a_forced_function_call_is_a_function_call_item(client):
    forced = dict(input="What's the weather in Paris?", tools=[WEATHER], temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=60)
    whole = client.responses.create(**forced)
    (call,) = whole.output
    assert (call.type, call.name) == ("function_call", "get_weather")
    assert json.loads(call.arguments)["city"] == "Paris"
    events = list(client.responses.create(**forced, stream=True))
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == [pieces] and pieces == call.arguments
    # the call and its output answer back in the next turn
    after = client.responses.create(previous_response_id=whole.id, max_output_tokens=8,
                                    temperature=0, input=[{
                                        "type": "function_call_output",
                                        "call_id": call.call_id, "output": "18C, sunny"}])
    assert after.status in ("completed", "incomplete") and after.output


def test_text_format_json_schema_is_followed(client):
    schema = {"type": "object", "properties": {"color": {"type": "string"}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(input="Pick a color.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c",
                                                 "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_background_response_cancelled_frees_its_blocks(server, client):
    queued = client.responses.create(input="Write a long story.", max_output_tokens=400,
                                     background=True)
    assert queued.status == "queued"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert server.kv_blocks_freed()
    with pytest.raises(openai.BadRequestError):           # only background ones cancel
        client.responses.cancel(client.responses.create(input=ASK, max_output_tokens=1).id)


def test_a_disconnect_mid_stream_frees_its_blocks(server):
    body = {"input": "Write a long story.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60,
                      headers={"Authorization": "Bearer k1"}) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break                                    # one delta, then hang up
    assert server.kv_blocks_freed()


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "bogus": 1}, 400, None),                       # unknown field
    ({"input": 5}, 400, None),                                     # wrong type
    ({"input": [{"role": "user", "content": "x"}] * 5000}, 400, "input"),
    ({"input": [{"type": "web_search_call"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
    ({"input": "x", "tools": [{"type": "file_search", "name": "f"}]}, 400, "tools"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x", "background": True, "stream": True}, 400, "background"),
])
def test_hostile_bodies_get_openai_errors(server, body, status, param):
    code, answer, _ = server.request("POST", "/v1/responses", body,
                                     {"Authorization": "Bearer k1"})
    assert code == status and answer["error"]["code"] == status
    assert answer["error"]["param"] == param
    assert server.healthy()


def test_requests_are_counted_by_api(server):
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    counts = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("pagewire:api_requests_total{")}
    assert counts["responses"] >= 10 and counts["openai"] == 1   # the one chat request


def test_the_key_is_required(server):
    code, answer, _ = server.request("POST", "/v1/responses", {"input": "x"})
    assert code == 401 and answer["error"]["type"] == "AuthenticationError"


def test_reasoning_is_a_reasoning_item_streamed_and_not():
    """--reasoning-parser deepseek_r1: the output starts in the reasoning block, so a short
    answer is reasoning alone, a reasoning item (reasoning_text deltas when streamed)."""
    with running_server(["--max-model-len", "512", "--kv-cache-memory", "32MiB",
                         "--reasoning-parser", "deepseek_r1"]) as srv:
        client = openai_client(srv)
        whole = client.responses.create(input=ASK, max_output_tokens=6, temperature=0)
        assert [item.type for item in whole.output] == ["reasoning"]
        text = whole.output[0].content[0].text
        events = list(client.responses.create(input=ASK, max_output_tokens=6, temperature=0,
                                              stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert text and deltas == text
        assert [e.type for e in events][-1] == "response.incomplete"
