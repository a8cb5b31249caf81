"""Ollama's API translated at the edge (gateway/ollama.py) and its answers shaped back
(gateway/ollama_door.py), without a server: options, format, think, messages, generate's two
modes, and a stream's objects from the OpenAI chunks the Formatter makes."""
from __future__ import annotations

import json

import msgspec
import pytest

from pagewire.gateway.constraints import requested_constraints
from pagewire.gateway.ollama import (ChatRequest, GenerateRequest, Options, chat_body,
                                     format_fields, generate_body, sampling_fields)
from pagewire.gateway.ollama_door import OllamaChat, OllamaGenerate
from pagewire.gateway.protocol import ApiError, ChatBody, CompletionBody
from pagewire.gateway.responses import Formatter
from pagewire.gateway.tools import ToolPlan
from pagewire.wire.ids import output_ids
from pagewire.wire.to_gateway import TextDelta


def chat_request(**fields) -> ChatRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return msgspec.convert({"model": "m:latest", **fields}, ChatRequest)


def test_options_map_to_the_openai_fields():
    opts = Options(num_predict=12, temperature=0.2, top_k=40, top_p=0.9, min_p=0.05,
                   stop=["\n"], seed=7, num_ctx=512, repeat_penalty=1.1, presence_penalty=0.5)
    assert sampling_fields(opts, 1024) == {
        "temperature": 0.2, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
        "repetition_penalty": 1.1, "stop": ["\n"], "top_k": 40, "seed": 7, "max_tokens": 12,
        "truncate_prompt_tokens": 512}
    # Ollama's "no limit" values, a random seed, no top-k cut, a num_ctx the server cannot grow
    assert sampling_fields(Options(num_predict=-1, seed=-1, top_k=-5, num_ctx=4096), 1024) == \
        {"top_k": 0}
    assert sampling_fields(Options(num_predict=-2), 1024) == {}
    for bad in (Options(num_predict=0), Options(num_predict=-3), Options(num_ctx=0)):
        with pytest.raises(ApiError) as e:
            sampling_fields(bad, 1024)
        assert e.value.status == 400 and e.value.param.startswith("options.")


def test_format_is_a_constraint():
    assert format_fields(None) == format_fields("") == {}
    json_object = ChatBody(messages=[], **format_fields("json"))
    assert requested_constraints(json_object) == [("response_format", {"json_object": True})]
    schema = {"type": "object"}
    assert requested_constraints(ChatBody(messages=[], **format_fields(schema))) == \
        [("response_format", {"json": schema})]
    with pytest.raises(ApiError, match="invalid format"):
        format_fields("yaml")


def test_chat_body_carries_messages_tools_and_think():
    req = chat_request(messages=[
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "thinking": "hmm",
         "tool_calls": [{"function": {"name": "t", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_name": "t", "content": "12:00"}],
        tools=[{"type": "function", "function": {"name": "t"}}], think="high",
        options={"num_predict": 3})
    body = chat_body(req, 1024, "openai_gptoss")
    assert (body.model, body.stream, body.max_tokens) == ("m", True, 3)
    assert body.chat_template_kwargs == {"reasoning_effort": "high"}
    call = body.messages[1].tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == ("t", {"zone": "UTC"})
    assert (body.messages[2].role, body.messages[2].name) == ("tool", "t")
    assert [t.function.name for t in body.tools] == ["t"]
    assert chat_body(chat_request(tools=[]), 1024, None).tools is None   # the client's default
    assert chat_body(chat_request(think=False), 1024, "qwen3").chat_template_kwargs == \
        {"enable_thinking": False}
    assert chat_body(chat_request(think=False), 1024, None).chat_template_kwargs is None
    for think, parser, words in ((True, None, "does not support thinking"),
                                 ("max", "qwen3", "one of high, medium, low")):
        with pytest.raises(ApiError, match=words):
            chat_body(chat_request(think=think), 1024, parser)


def test_generate_is_a_chat_unless_raw():
    req = msgspec.convert({"model": "m", "prompt": "p", "system": "s", "stream": False},
                          GenerateRequest)
    body = generate_body(req, 1024, None)
    assert isinstance(body, ChatBody) and not body.stream
    assert [(m.role, m.content) for m in body.messages] == [("system", "s"), ("user", "p")]
    raw = msgspec.convert({"model": "m", "prompt": "p", "raw": True, "logprobs": True,
                           "top_logprobs": 3}, GenerateRequest)
    body = generate_body(raw, 1024, None)
    assert isinstance(body, CompletionBody)
    assert (body.prompt, body.logprobs, body.max_tokens) == ("p", 3, None)
    with pytest.raises(ApiError, match="template is not supported"):
        generate_body(msgspec.convert({"model": "m", "prompt": "p", "template": "{{ .Prompt }}"},
                                      GenerateRequest), 1024, None)


def deltas(texts: list[str], reason: str) -> list[TextDelta]:
    (seq,) = output_ids("r-0", 1)
    return [TextDelta(seq, t, 9, i + 1, reason if i == len(texts) - 1 else None)
            for i, t in enumerate(texts)]


def test_a_named_tool_call_streams_as_one_ollama_call():
    fmt = Formatter(True, "r", 0, "m", tools=ToolPlan(mode="named", function="t"))
    door = OllamaChat(fmt)
    lines = [json.loads(line) for d in deltas(['{"zo', 'ne": "UTC"}'], "stop")
             for chunk in fmt.chunks(0, d) for line in door.events(chunk)]
    lines += [json.loads(line) for line in door.closing({"prompt_tokens": 9,
                                                         "completion_tokens": 2})]
    assert [line["done"] for line in lines] == [False, True]
    assert lines[0]["message"] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": lines[0]["message"]["tool_calls"][0]["id"],
         "function": {"index": 0, "name": "t", "arguments": {"zone": "UTC"}}}]}
    end = lines[1]
    assert (end["done_reason"], end["prompt_eval_count"], end["eval_count"],
            end["load_duration"]) == ("stop", 9, 2, 0)
    assert end["message"] == {"role": "assistant", "content": ""} and end["model"] == "m"


def test_generate_streams_responses_and_answers_whole():
    fmt = Formatter(False, "r", 0, "m", logprobs=True)
    door = OllamaGenerate(fmt)
    lines = [json.loads(line) for d in deltas([" a", " b"], "length")
             for chunk in fmt.chunks(0, d) for line in door.events(chunk)]
    assert [(line["response"], line["done"]) for line in lines] == [(" a", False), (" b", False)]
    whole = door.full({"choices": [{"text": " a b", "finish_reason": "length", "logprobs": {
        "tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" a": -0.5, " c": -2.0}],
        "text_offset": [0]}}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert (whole["response"], whole["done"], whole["done_reason"], whole["eval_count"]) == \
        (" a b", True, "length", 2)
    assert whole["logprobs"] == [{"token": " a", "logprob": -0.5, "bytes": [32, 97],
                                  "top_logprobs": [
                                      {"token": " a", "logprob": -0.5, "bytes": [32, 97]},
                                      {"token": " c", "logprob": -2.0, "bytes": [32, 99]}]}]
    assert OllamaGenerate.error_body(ApiError(400, "bad")) == {"error": "bad"}
    assert door.failed(ApiError(500, "boom")) == [b'{"error":"boom"}\n']


def test_reasoning_is_thinking_streamed_and_whole():
    fmt = Formatter(True, "r", 0, "m", reasoning_parser="deepseek_r1")
    door = OllamaChat(fmt)
    lines = [json.loads(line) for d in deltas(["why", "</think>", "Paris"], "stop")
             for chunk in fmt.chunks(0, d) for line in door.events(chunk)]
    assert [line["message"] for line in lines] == [
        {"role": "assistant", "content": "", "thinking": "why"},
        {"role": "assistant", "content": "Paris"}]
    message, reason = fmt.chat_output().message("why</think>Paris", "stop")
    whole = door.full({"choices": [{"message": message, "finish_reason": reason,
                                    "logprobs": None}],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    assert whole["message"] == {"role": "assistant", "content": "Paris", "thinking": "why"}
    generated = OllamaGenerate(fmt).full(
        {"choices": [{"message": message, "finish_reason": reason, "logprobs": None}],
         "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    assert (generated["response"], generated["thinking"]) == ("Paris", "why")
