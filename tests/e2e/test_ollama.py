"""Ollama's API on a real `pagewire serve` (default model, an API key set), through Ollama's own
Python client: chat and generate streamed and not, options, `format`, tools, logprobs, the
model listings, an abort on disconnect freeing the KV blocks, and hostile bodies answered
with Ollama's {"error": "..."} while the server goes on."""
from __future__ import annotations

import json
import time
import urllib.request

import jsonschema
import ollama
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagewire.testing.server import openai_client, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
KEY = "ollama-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 20}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}}}
# The server reads calls as llama3_json: the whole output {"name", "parameters"}; `format`
# holds this small model to one such call.
CALL = {"type": "object", "properties": {
    "name": {"const": "get_time"}, "parameters": TIME["function"]["parameters"]},
    "required": ["name", "parameters"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    with running_server(["--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                         "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                         "--api-key", KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers=AUTH)


def test_chat_streamed_and_not_agree_with_the_openai_route(server, client):
    full = client.chat(model=MODEL, messages=FRANCE, options=GREEDY)
    assert "Paris" in full.message.content and full.message.role == "assistant"
    assert (full.done, full.done_reason, full.load_duration) == (True, "stop", 0)
    assert full.prompt_eval_count > 10 and full.eval_count > 3
    assert full.total_duration >= full.prompt_eval_duration + full.eval_duration
    assert full.prompt_eval_duration > 0 and full.eval_duration > 0
    parts = list(client.chat(model=MODEL, messages=FRANCE, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == full.message.content
    assert (parts[-1].done_reason, parts[-1].eval_count, parts[-1].prompt_eval_count) == \
        ("stop", full.eval_count, full.prompt_eval_count)
    openai = openai_client(server, KEY).chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=20)
    assert openai.choices[0].message.content == full.message.content
    assert openai.usage.completion_tokens == full.eval_count


def test_generate_raw_is_the_completion_and_num_predict_is_exact(server, client):
    opts = {"temperature": 0, "num_predict": 7}
    full = client.generate(model=MODEL, prompt="1, 2, 3,", raw=True, options=opts)
    assert (full.eval_count, full.done_reason) == (7, "length")
    streamed = list(client.generate(model=MODEL, prompt="1, 2, 3,", raw=True, options=opts,
                                    stream=True))
    assert "".join(p.response for p in streamed) == full.response
    assert streamed[-1].eval_count == 7 and streamed[-1].done
    openai = openai_client(server, KEY).completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=7)
    assert openai.choices[0].text == full.response
    stopped = client.generate(model=MODEL, prompt="1, 2, 3,", raw=True,
                              options={"temperature": 0, "num_predict": 20, "stop": [" 6"]})
    assert (stopped.response, stopped.done_reason) == (" 4, 5,", "stop")


def test_generate_applies_the_chat_template_unless_raw(client):
    generated = client.generate(model=MODEL, prompt=FRANCE[0]["content"], options=GREEDY)
    chat = client.chat(model=MODEL, messages=FRANCE, options=GREEDY)
    assert generated.response == chat.message.content
    assert generated.prompt_eval_count == chat.prompt_eval_count
    with_system = client.generate(model=MODEL, prompt=FRANCE[0]["content"], options=GREEDY,
                                  system="Answer in one word.")
    assert with_system.prompt_eval_count != chat.prompt_eval_count


def test_a_seed_repeats_a_sampled_answer(client):
    opts = {"temperature": 1.0, "seed": 1234, "num_predict": 16, "top_k": 50, "top_p": 0.95}
    first = client.chat(model=MODEL, messages=FRANCE, options=opts)
    assert client.chat(model=MODEL, messages=FRANCE, options=opts).message.content == \
        first.message.content


def test_format_json_schema_and_json(client):
    ask = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    full = client.chat(model=MODEL, messages=ask, format=PERSON, options={"temperature": 0,
                                                                         "num_predict": 60})
    jsonschema.validate(json.loads(full.message.content), PERSON)
    streamed = client.chat(model=MODEL, messages=ask, format=PERSON, stream=True,
                           options={"temperature": 0, "num_predict": 60})
    assert "".join(p.message.content for p in streamed) == full.message.content
    obj = client.generate(model=MODEL, prompt=ask[0]["content"], format="json",
                          options={"temperature": 0, "num_predict": 120})
    assert obj.response.lstrip().startswith("{")
    if obj.done_reason == "stop":
        assert isinstance(json.loads(obj.response), dict)


def test_tool_calls_come_whole_with_object_arguments(client):
    kw = dict(model=MODEL, messages=FRANCE, tools=[TIME], format=CALL,
              options={"temperature": 0, "num_predict": 40})
    full = client.chat(**kw)
    [call] = full.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments["zone"] in ("UTC", "CET")
    assert (full.message.content, full.done_reason) == ("", "stop")
    parts = list(client.chat(stream=True, **kw))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(call.function.name, call.function.arguments)]
    history = FRANCE + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_name": "get_time", "content": "12:00"}]
    answer = client.chat(model=MODEL, messages=history, tools=[TIME],
                         options={"temperature": 0, "num_predict": 4})
    assert answer.done_reason in ("stop", "length") and answer.prompt_eval_count > \
        full.prompt_eval_count


def test_logprobs(client):
    r = client.chat(model=MODEL, messages=FRANCE, logprobs=True, top_logprobs=2,
                    options={"temperature": 0, "num_predict": 5})
    assert len(r.logprobs) == r.eval_count == 5
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in r.logprobs)
    assert "".join(e.token for e in r.logprobs) == r.message.content


def test_models_show_version_and_the_probe(server, client):
    (entry,) = client.list().models
    assert entry.model == MODEL and entry.size > 50 * 2**20
    assert (entry.details.family, entry.details.format, entry.details.parameter_size,
            entry.details.quantization_level) == ("llama", "gguf", "135M", "Q4_1")
    shown = client.show(MODEL + ":latest")
    assert shown.capabilities == ["completion", "tools"] and "<|im_start|>" in shown.template
    assert shown.modelinfo["llama.context_length"] == 1024
    assert shown.modelinfo["general.parameter_count"] == 134515008
    (running,) = client.ps().models
    assert (running.model, running.context_length) == (MODEL, 1024)
    assert server.request("GET", "/api/version", headers=AUTH)[1]["version"] == "0.12.0"
    with urllib.request.urlopen(server.url + "/") as r:
        assert r.read() == b"Ollama is running"
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404
    loaded = client.chat(model=MODEL, messages=[])
    assert (loaded.done, loaded.done_reason, loaded.message.content) == (True, "load", "")


def test_the_api_key_guards_api(server):
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url).list()
    assert (e.value.status_code, e.value.error) == (401, "invalid or missing API key")


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "malformed JSON"),
    ({"model": MODEL, "messages": "hi"}, 400, "Expected `array`, got `str`"),
    ({"model": MODEL, "messages": FRANCE, "options": {"temperature": "hot"}}, 400,
     "Expected `float | null`, got `str` - at `$.options.temperature`"),
    ({"model": MODEL, "messages": FRANCE, "stream": "yes"}, 400, "Expected `bool`"),
    ({"model": MODEL, "messages": FRANCE, "format": 5}, 400, "Expected"),
    ({"model": MODEL, "messages": FRANCE, "format": "yaml"}, 400, "invalid format"),
    ({"model": MODEL, "messages": FRANCE * 4097}, 400, "messages may hold at most 4096"),
    ({"model": MODEL, "messages": FRANCE, "tools": [TIME] * 129}, 400, "at most 128"),
    ({"model": MODEL, "messages": FRANCE, "options": {"stop": ["x"] * 65}}, 400, "at most 64"),
    ({"model": MODEL, "messages": FRANCE, "options": {"num_predict": 0}}, 400, "num_predict"),
    ({"model": MODEL, "messages": FRANCE, "options": {"num_predict": 5000}}, 400,
     "maximum context length"),
    ({"model": MODEL, "messages": FRANCE, "think": True}, 400, "does not support thinking"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}], },
     400, "this model takes no images"),
    ({"model": "nope", "messages": FRANCE}, 404, "does not exist"),
    ({"messages": FRANCE}, 400, "missing required field `model`"),
])
def test_hostile_chat_bodies_get_ollamas_error_and_the_server_goes_on(server, client, body,
                                                                       status, words):
    code, reply, _ = server.request("POST", "/api/chat", body, headers=AUTH)
    assert code == status and list(reply) == ["error"] and words in reply["error"], reply
    assert client.chat(model=MODEL, messages=FRANCE, options={"num_predict": 1}).done


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix is not supported"),
    ({"model": MODEL, "prompt": "x", "context": [1, 2]}, "context is not supported"),
    ({"model": MODEL, "prompt": ["x"]}, "Expected `str`"),
    ({"model": MODEL, "prompt": "x", "raw": True, "top_logprobs": 21, "logprobs": True},
     "between 0 and 20"),
])
def test_hostile_generate_bodies(server, body, words):
    code, reply, _ = server.request("POST", "/api/generate", body, headers=AUTH)
    assert code == 400 and list(reply) == ["error"] and words in reply["error"], reply


def scrape(server) -> dict[str, float]:
    """Sample name (with its `api` label where it has one) -> value, of the unlabelled and
    the per-api samples."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name + (f"/{s.labels['api']}" if "api" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if not s.labels.get("finished_reason")
            and not s.labels.get("type")}


def poll(server, done, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not done(samples := scrape(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return samples


def test_a_disconnect_mid_stream_frees_its_blocks(server, client):
    before = scrape(server)
    stream = client.generate(model=MODEL, prompt="1, 2, 3,", raw=True, stream=True,
                             options={"temperature": 0, "num_predict": 900})
    for i, _ in enumerate(stream):
        if i == 1:
            break
    busy = poll(server, lambda s: s["vllm:num_requests_running"] == 1)
    assert busy["vllm:kv_cache_usage_perc"] > 0 and busy["pagewire:requests_in_flight"] == 1
    stream.close()
    after = poll(server, lambda s: s["vllm:num_requests_running"] == 0
                 and s["vllm:kv_cache_usage_perc"] == 0)
    assert (after["vllm:num_requests_running"], after["vllm:kv_cache_usage_perc"],
            after["pagewire:requests_in_flight"]) == (0, 0, 0)
    counted = {api: after.get(f"pagewire:api_requests_total/{api}", 0) -
               before.get(f"pagewire:api_requests_total/{api}", 0) for api in ("ollama", "openai")}
    assert counted == {"ollama": 1, "openai": 0}
