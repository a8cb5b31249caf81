"""A chat choice's message from its text (gateway/chat_output.py, gateway/tools.py): tool
choice planning, the three tool-call parsers, the reasoning parsers, and streaming giving the
same message as the whole text however the text is cut."""
from __future__ import annotations

import json

import pytest

from pagewire.config import EngineConfig
from pagewire.gateway.chat_output import ChatOutput, split_reasoning
from pagewire.gateway.tools import (CALL_WHITESPACE, FunctionDef, NamedFunction,
                                    NamedToolChoice, Tool, ToolPlan, calls_of, plan_tools)
from pagewire.wire.sampling_params import InvalidParam

TOOLS = [Tool(function=FunctionDef(name="f", parameters={"type": "object", "properties": {
    "x": {"type": "integer"}}})), Tool(function=FunctionDef(name="g"))]
AUTO = EngineConfig.from_options(enable_auto_tool_choice=True, tool_call_parser="hermes")
OFF = EngineConfig.from_options(enable_auto_tool_choice=False, tool_call_parser=None)


def test_tool_choice_plans():
    assert plan_tools(None, None, True, OFF) == ToolPlan()
    assert plan_tools(TOOLS, "none", True, OFF) == ToolPlan()          # tools kept out
    named = plan_tools(TOOLS, NamedToolChoice(function=NamedFunction(name="g")), True, OFF)
    assert (named.mode, named.function) == ("named", "g")
    assert named.constraint == [("tool_choice", {"json": {"type": "object", "properties": {}},
                                                 "disable_additional_properties": True,
                                                 "whitespace_pattern": CALL_WHITESPACE})]
    required = plan_tools(TOOLS, "required", False, OFF)
    schema = required.constraint[0][1]["json"]
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert [t["function"]["name"] for t in required.template_tools] == ["f", "g"]
    assert required.constraint[0][1]["disable_additional_properties"] is True
    assert required.functions == ["f", "g"]
    assert plan_tools(TOOLS, "auto", True, AUTO).parser == "hermes"


@pytest.mark.parametrize("tools, choice, config, words", [
    (TOOLS, "auto", OFF, "requires --enable-auto-tool-choice"),
    (TOOLS, None, OFF, "requires --enable-auto-tool-choice"),
    (None, "required", OFF, "tool_choice needs tools"),
    (TOOLS, "sometimes", AUTO, "must be none, auto, required"),
])
def test_tool_choice_refusals(tools, choice, config, words):
    with pytest.raises(InvalidParam, match=words) as e:
        plan_tools(tools, choice, True, config)
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me check.\n",
     [("f", {"x": 1}), ("g", {})]),
    ("hermes", "No call here.", "No call here.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": </tool_call>', []),       # broken: text
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 2}}; '
     '{"name": "g", "parameters": {}}', None, [("f", {"x": 2}), ("g", {})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("mistral", 'ok[TOOL_CALLS][{"name": "f", "arguments": {"x": 3}}]', "ok", [("f", {"x": 3})]),
])
def test_tool_call_parsers(parser, text, content, calls):
    got_content, got = calls_of(ToolPlan(mode="auto", parser=parser), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("deepseek_r1", "think hard</think>\n\nThe answer.", "think hard", "The answer."),
    ("deepseek_r1", "<think>still thinking", "still thinking", ""),
    ("qwen3", "<think>hmm</think>Yes.", "hmm", "Yes."),
    ("qwen3", "Just an answer.", None, "Just an answer."),
    (None, "<think>x</think>y", None, "<think>x</think>y"),
    ("openai_gptoss", "<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant"
     "<|channel|>final<|message|>4<|return|>", "2 + 2 is 4.", "4"),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut short", "cut short", ""),
    ("openai_gptoss", "<|channel|>final<|message|>At once.", None, "At once."),
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>"
     "commentary<|message|>b<|end|><|start|>assistant<|channel|>final <|constrain|>json"
     "<|message|>{}<|return|>", "a\nb", "{}"),         # messages joined as vLLM joins them
    ("openai_gptoss", "no harmony here", "no harmony here", ""),
    ("openai_gptoss", "<|channel|>analysis<|message|>x <|e|> y<|end|><|start|>assistant<|chan",
     "x <|e|> y", ""),                       # a marker-like body; a header cut short: dropped
])
def test_reasoning_split(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)


def _stream(out: ChatOutput, text: str, cut: int, reason: str = "stop"):
    deltas = []
    for i in range(0, len(text), cut):
        deltas += out.feed(text[i:i + cut])
    rest, reason = out.finish(reason)
    deltas += rest
    fields = {"content": "", "reasoning_content": ""}
    calls = {}
    for d in deltas:
        for key in fields:
            fields[key] += d.get(key, "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            call["name"] += c["function"].get("name", "")
            call["arguments"] += c["function"]["arguments"]
    return fields, [calls[i] for i in sorted(calls)], reason


HARMONY_CALLS = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 '{"city": "SF"}<|call|><|start|>assistant to=functions.get_time<|channel|>'
                 'commentary json<|message|>{"tz": "PST"}<|call|>')
HARMONY = ("<|channel|>analysis<|message|>Think: <b>|a|</b> then more.<|end|><|start|>assistant"
           "<|channel|>analysis<|message|>Second thought.<|end|><|start|>assistant<|channel|>"
           "final<|message|>Final <|answer|>.<|return|>")


@pytest.mark.parametrize("tools, parser, text", [
    (ToolPlan(), "deepseek_r1", "a b</think>\n\nc d"),
    (ToolPlan(), "qwen3", "<think>deep</think>plain"),
    (ToolPlan(), "qwen3", "<thin is not a tag"),
    (ToolPlan(mode="auto", parser="hermes"), None,
     'Sure <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'),
    (ToolPlan(mode="auto", parser="hermes"), None, "a <tool but no call"),
    (ToolPlan(mode="auto", parser="llama3_json"), None, ' {"name": "g", "parameters": {}}'),
    (ToolPlan(mode="auto", parser="llama3_json"), None, "words {not a call}"),
    (ToolPlan(mode="auto", parser="mistral"), "qwen3",
     '<think>plan</think>[TOOL_CALLS][{"name": "f", "arguments": {"x": 5}}]'),
    (ToolPlan(mode="required"), None, '[{"name": "f", "parameters": {"x": 1}}]'),
    (ToolPlan(mode="required"), None, '[ {\n "name" : "f",\n "parameters": {"s": "}]\\"{"}}, '
                                      '{"name":"g","parameters":{}} ]'),
    (ToolPlan(mode="named", function="f"), None, '{"x": 7}'),
    (ToolPlan(mode="named", function="f"), "qwen3", '<think>f it is</think>{"x": 7}'),
    (ToolPlan(), "openai_gptoss", HARMONY),
    (ToolPlan(), "openai_gptoss", "<|channel|>analysis<|message|>only <|ret thinking"),
    (ToolPlan(mode="auto", parser="openai"), "openai_gptoss", HARMONY_CALLS),
    (ToolPlan(mode="auto", parser="openai"), "openai_gptoss", HARMONY),
    (ToolPlan(mode="auto", parser="hermes"), "openai_gptoss",
     '<|channel|>analysis<|message|>call f<|end|><|start|>assistant<|channel|>final<|message|>'
     'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><|return|>'),
])
@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_streaming_gives_the_whole_texts_message(tools, parser, text, cut):
    whole, whole_reason = ChatOutput(tools, parser).message(text, "stop")
    fields, calls, reason = _stream(ChatOutput(tools, parser), text, cut)
    assert fields["content"] == (whole["content"] or "")
    assert fields["reasoning_content"] == (whole.get("reasoning_content") or "")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    assert reason == whole_reason == ("tool_calls" if calls else "stop")


def test_harmony_streamed_in_any_two_pieces_or_by_tokens_gives_the_whole_message():
    """Every cut of the text into two, and the token pieces a detokenizer sends (a marker
    whole, a word apart): the same reasoning and content as the whole text."""
    import re
    whole, _ = ChatOutput(ToolPlan(), "openai_gptoss").message(HARMONY, "stop")
    expected = {"content": "Final <|answer|>.",
                "reasoning_content": "Think: <b>|a|</b> then more.\nSecond thought."}
    assert {k: whole[k] for k in expected} == expected
    tokens = re.findall(r"<\|[a-z]+\|>|\s?[^<\s]+|\s?<", HARMONY)
    assert "".join(tokens) == HARMONY
    cuts = [[HARMONY[:i], HARMONY[i:]] for i in range(len(HARMONY) + 1)] + [tokens]
    for pieces in cuts:
        out = ChatOutput(ToolPlan(), "openai_gptoss")
        deltas = [d for p in pieces for d in out.feed(p)] + out.finish("stop")[0]
        got = {k: "".join(d.get(k, "") for d in deltas) for k in expected}
        assert got == expected, pieces


def test_harmony_calls_are_messages_to_functions():
    """--tool-call-parser openai: each commentary message to functions.NAME (the recipient
    before or after the channel) is a call, its body the arguments; the analysis stays
    reasoning; without the parser the calls' bodies are reasoning too."""
    msg, reason = ChatOutput(ToolPlan(mode="auto", parser="openai"), "openai_gptoss").message(
        HARMONY_CALLS, "stop")
    assert reason == "tool_calls" and msg["reasoning_content"] == "Need the weather."
    assert not msg["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [("get_weather", '{"city": "SF"}'), ("get_time", '{"tz": "PST"}')]
    plain, reason = ChatOutput(ToolPlan(), "openai_gptoss").message(HARMONY_CALLS, "stop")
    assert reason == "stop" and "tool_calls" not in plain
    assert plain["reasoning_content"] == 'Need the weather.\n{"city": "SF"}\n{"tz": "PST"}'


def test_harmony_calls_need_the_harmony_reasoning_parser():
    with pytest.raises(ValueError, match="needs --reasoning-parser openai_gptoss"):
        EngineConfig.from_options(max_model_len=512, kv_cache_memory=64 * 2**20,
                                  tool_call_parser="openai").resolve()
    EngineConfig.from_options(max_model_len=512, kv_cache_memory=64 * 2**20,
                              enable_auto_tool_choice=True, tool_call_parser="openai",
                              reasoning_parser="openai_gptoss").resolve()


REQUIRED = ToolPlan(mode="required", functions=["get_weather", "get_time"])
NAMED = ToolPlan(mode="named", function="get_weather")


@pytest.mark.parametrize("tools, text, calls", [
    (NAMED, '{"city": "Par', [("get_weather", '{"city": "Par')]),
    (NAMED, "", [("get_weather", "")]),                   # cut before its first character
    (REQUIRED, '[{"name": "get_time", "parameters": {"zone": "U',
     [("get_time", '{"zone": "U')]),
    (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_t',
     [("get_weather", '{"city": "Paris"}'), ("get_time", "")]),    # a name's unique start
    (REQUIRED, '[{"name": "get_', []),                  # not yet decided between the two
    (REQUIRED, '[{"name": "get_weather", "parameters": 12', [("get_weather", "12")]),
    (ToolPlan(mode="required", functions=["only"]), "[", [("only", "")]),
])
@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_a_forced_choice_cut_short_still_reports_its_calls(tools, text, calls, cut):
    """named / required: the constrained text is the call(s), whatever max_tokens cut off."""
    msg, reason = ChatOutput(tools, None).message(text, "length")
    assert msg["content"] is None and reason == "length"
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls", [])] == calls
    fields, streamed, reason = _stream(ChatOutput(tools, None), text, cut, "length")
    assert fields["content"] == "" and reason == "length"
    assert [(c["name"], c["arguments"]) for c in streamed] == calls


@pytest.mark.parametrize("cut", [1, 1000])
def test_a_named_choice_cut_short_in_its_reasoning_still_reports_the_call(cut):
    msg, reason = ChatOutput(NAMED, "deepseek_r1").message("Paris, so", "length")
    assert (msg["reasoning_content"], msg["content"], reason) == ("Paris, so", None, "length")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [("get_weather", "")]
    fields, calls, reason = _stream(ChatOutput(NAMED, "deepseek_r1"), "Paris, so", cut, "length")
    assert (fields["reasoning_content"], fields["content"], reason) == ("Paris, so", "", "length")
    assert calls == [{"name": "get_weather", "arguments": ""}]


def test_forced_calls_stream_as_deltas_with_id_type_and_name_first():
    out = ChatOutput(REQUIRED, None)
    deltas = [d for piece in ('[{"name": "get_w', 'eather", "parameters": {"ci', 'ty": "Paris"}',
                              '}, {"name": "get_time", "parameters": {}}]')
              for d in out.feed(piece)]
    rest, reason = out.finish("stop")
    calls = [c for d in deltas + rest for c in d["tool_calls"]]
    assert reason == "tool_calls" and all(set(d) == {"tool_calls"} for d in deltas + rest)
    heads = [c for c in calls if "id" in c]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in heads] == \
        [(0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in heads)
    assert [c["function"]["arguments"] for c in calls if c["index"] == 0] == \
        ["{\"ci", 'ty": "Paris"}']
    named = ChatOutput(NAMED, None)
    [first] = named.feed('{"city"')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert named.feed(': "Rome"}') == [{"tool_calls": [{"index": 0, "function": {
        "arguments": ': "Rome"}'}}]}]
    assert named.finish("stop") == ([], "tool_calls")
