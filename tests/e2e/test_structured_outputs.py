"""Structured outputs and tool calls over HTTP with the default model and the official client:
each request shape (response_format, structured_outputs, vLLM's guided_* fields, tools with
required / named / auto choice), streamed and not, and the 400s for bad constraints."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagewire.testing.server import openai_client, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
PARAMS = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, TIME)}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# The model's template, with the tools listed in a system turn and earlier calls rendered.
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions, answering <tool_call>{"name": ..., "arguments": ...}</tool_call>:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>\
{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    with running_server(["--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                         "--chat-template", str(template), "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _chat(client, stream=False, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 60)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, stream=stream, **kw)


def _streamed(chunks) -> tuple[str, list[dict], str]:
    """(content, tool calls assembled from their deltas, finish_reason) of a chat stream."""
    text, calls, reason = "", {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason


def test_json_schema_response_format_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    full = _chat(client, response_format=fmt)
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)
    assert full.choices[0].finish_reason == "stop"
    text, _, reason = _streamed(_chat(client, stream=True, response_format=fmt))
    assert (text, reason) == (full.choices[0].message.content, "stop")


def test_json_object_and_the_older_guided_json(client):
    obj = _chat(client, response_format={"type": "json_object"}, max_tokens=120)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.lstrip().startswith("{")
    guided = _chat(client, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(guided.choices[0].message.content), PERSON)


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[A-Z][a-z]{1,8} is [0-9]{1,2}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{1,8} is [0-9]{1,2}", t)),
    ({"choice": ["Paris", "Rome", "Madrid"]}, lambda t: t in ("Paris", "Rome", "Madrid")),
    ({"grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
     lambda t: t in ("The answer is yes.", "The answer is no.")),
    ({"grammar": 'start: "x=" /[0-9]{3}/'}, lambda t: re.fullmatch(r"x=[0-9]{3}", t)),
])
def test_structured_outputs_on_completions_streamed_and_not(client, constraint, check):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=30, temperature=0,
              extra_body={"structured_outputs": constraint})
    full = client.completions.create(**kw)
    assert check(full.choices[0].text) and full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == full.choices[0].text


def test_every_one_of_n_sampled_outputs_matches(client):
    r = _chat(client, n=4, temperature=1.0, seed=5,
              extra_body={"structured_outputs": {"regex": r"(red|green|blue)( and (red|blue))?"}})
    assert len(r.choices) == 4
    for c in r.choices:
        assert re.fullmatch(r"(red|green|blue)( and (red|blue))?", c.message.content)


def test_tool_choice_required_returns_valid_calls_streamed_and_not(client):
    kw = dict(messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required",
              max_tokens=80, parallel_tool_calls=False)
    full = _chat(client, **kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    text, calls, reason = _streamed(_chat(client, stream=True, **kw))
    assert (text, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(call.function.name, call.function.arguments)]


def test_a_named_tool_choice_returns_its_function_streamed_and_not(client):
    kw = dict(messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=80,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = _chat(client, **kw)
    [call] = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and full.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])
    _, calls, reason = _streamed(_chat(client, stream=True, **kw))
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather",
                                                            call.function.arguments)]
    assert reason == "tool_calls"


# Issue #45: get_weather(city, unit) as a client writes it, saying nothing of other keys;
# held to it, the default model once added "country", "unit_low", ... until max_tokens.
OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
ASK_PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _arguments(call) -> dict:
    """A finished call's arguments: JSON with its required keys and no others."""
    args = json.loads(call.function.arguments)
    assert "city" in args and set(args) <= {"city", "unit"}, args
    return args


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_choice_is_a_call_of_the_declared_keys_streamed_and_not(client, choice):
    kw = dict(messages=ASK_PARIS, tools=[OPEN_WEATHER], tool_choice=choice, max_tokens=60,
              parallel_tool_calls=False)
    choice = _chat(client, **kw).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"
    _arguments(call)
    text, calls, reason = _streamed(_chat(client, stream=True, **kw))
    assert (text, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather",
                                                            call.function.arguments)]
    assert calls[0]["id"].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_cut_short_is_still_reported(client, choice):
    kw = dict(messages=ASK_PARIS, tools=[OPEN_WEATHER, TIME], tool_choice=choice,
              parallel_tool_calls=False)
    whole = _chat(client, max_tokens=60, **kw).choices[0].message.tool_calls[0]
    cut = _chat(client, max_tokens=14, **kw).choices[0]
    assert (cut.finish_reason, cut.message.content) == ("length", None)
    [call] = cut.message.tool_calls
    assert call.function.name == whole.function.name           # greedy: the same call, begun
    assert whole.function.arguments.startswith(call.function.arguments)
    assert call.function.arguments != whole.function.arguments
    text, calls, reason = _streamed(_chat(client, stream=True, max_tokens=14, **kw))
    assert (text, reason) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name,
                                                            call.function.arguments)]


def test_auto_tool_choice_parses_the_models_hermes_calls(client):
    # The model is held to one call in Hermes syntax, as a tool-calling model would write it.
    said = 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    kw = dict(messages=ASK_WEATHER, tools=[WEATHER, TIME],
              extra_body={"structured_outputs": {"choice": [said]}})
    full = _chat(client, **kw)
    message = full.choices[0].message
    assert message.content == "Sure. " and full.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                        {"zone": "UTC"})
    text, calls, reason = _streamed(_chat(client, stream=True, **kw))
    assert (text, reason) == ("Sure. ", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]


def test_tools_and_earlier_calls_reach_the_chat_template(client):
    plain = _chat(client, messages=ASK_WEATHER, max_tokens=1)
    with_tools = _chat(client, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    none = _chat(client, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    answer = _chat(client, messages=history, tools=[WEATHER], max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param, words", [
    ({"structured_outputs": {"json": {"type": "object", "not": {}}}}, "structured_outputs",
     'Unimplemented keys: ["not"]'),
    ({"structured_outputs": {"json": '{"type": '}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs",
     "unknown name"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
    ({"structured_outputs": {"choice": ["a"] * 1025}}, "structured_outputs", "at most 1024"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "response_format", "only one output constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "only one output constraint"),
    ({"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, "ignore_eos", "cannot be"),
])
def test_a_bad_constraint_is_a_400_and_the_server_answers_the_next_request(
        server, client, body, param, words):
    code, reply, _ = server.request("POST", "/v1/chat/completions",
                                    {"messages": ASK, "max_tokens": 4, **body})
    assert code == 400 and reply["error"]["param"] == param, reply
    assert words in reply["error"]["message"]
    assert _chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")
