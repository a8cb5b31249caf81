"""Tool calls: the request's `tools` and `tool_choice` turned into what the prompt and the
output constraint need, and the model's text turned back into OpenAI tool calls.

- `none`: the tools stay out of the prompt; the output is text.
- `required` / a named function: the output is constrained (structured outputs) to the
  functions' argument schemas: a JSON list of {"name", "parameters"} objects for `required`
  (one object unless parallel_tool_calls), the named function's arguments object itself
  otherwise. The schemas are closed as OpenAI's strict function calling closes them: an
  object schema naming its properties takes no others unless it says additionalProperties,
  so a small model cannot ramble on in keys of its own. The output is the call(s) whatever
  a parser would make of free text: tool_calls with finish_reason `tool_calls`, or `length`
  with the calls begun (their arguments cut short) still reported (call_list.py reads them).
- `auto` (the default with tools) needs --enable-auto-tool-choice: the output is free and the
  --tool-call-parser finds calls in the model's own syntax (PARSERS).
"""
from __future__ import annotations

import json
import uuid

import msgspec

from pagewire.wire.sampling_params import InvalidParam

from .call_list import CallList, ToolCall

_NO_PARAMETERS = {"type": "object", "properties": {}}
# The whitespace a forced call may hold between its JSON's tokens: a space, or one line break
# and an indent (pretty-printed JSON, 40 columns deep), never runs of blank lines. With the
# closed schemas this bounds a call's whitespace by its keys: a model cannot ramble in it.
CALL_WHITESPACE = r"[ \t]?|\r?\n[ \t]{0,40}"


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class ToolPlan(msgspec.Struct, kw_only=True):
    """What one chat request's tools decide: the tools the template sees, the constraint
    asked (as constraints.requested_constraints lists them) and how the output is read."""
    template_tools: list[dict] | None = None
    constraint: list[tuple[str, dict]] = []
    mode: str = "text"          # text | required | named | auto
    function: str | None = None      # the named function
    functions: list[str] = []        # the tools' names (required)
    parser: str | None = None        # the tool-call parser of `auto`


def plan_tools(tools: list[Tool] | None, choice, parallel: bool, config) -> ToolPlan:
    """The ToolPlan of a request's tools, tool_choice and parallel_tool_calls."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidParam("tool_choice", "tool_choice needs tools")
        return ToolPlan()
    if any(t.type != "function" for t in tools):
        raise InvalidParam("tools", "only tools of type function are supported")
    dicts = [msgspec.to_builtins(t) for t in tools]
    if choice == "none":
        return ToolPlan()
    if isinstance(choice, NamedToolChoice):
        by_name = {t.function.name: t.function for t in tools}
        if choice.function.name not in by_name:
            raise InvalidParam("tool_choice", f"tool_choice names {choice.function.name!r}, "
                               f"which is not among the tools ({', '.join(by_name)})")
        schema = by_name[choice.function.name].parameters or _NO_PARAMETERS
        return ToolPlan(template_tools=dicts, constraint=[("tool_choice", _forced_constraint(schema))],
                        mode="named", function=choice.function.name)
    if choice == "required":
        return ToolPlan(template_tools=dicts, mode="required",
                        functions=[t.function.name for t in tools],
                        constraint=[("tool_choice", _forced_constraint(_calls_schema(tools, parallel)))])
    if choice not in (None, "auto"):
        raise InvalidParam("tool_choice", f"tool_choice must be none, auto, required or a "
                           f"named function, got {choice!r}")
    if not (config.server.enable_auto_tool_choice and config.server.tool_call_parser):
        raise InvalidParam("tool_choice", '"auto" tool choice requires '
                           "--enable-auto-tool-choice and --tool-call-parser to be set")
    return ToolPlan(template_tools=dicts, mode="auto", parser=config.server.tool_call_parser)


def _forced_constraint(schema: dict) -> dict:
    """A forced call's constraint: its objects take only the properties they name unless they
    say otherwise (the grammar compiler closes them), its whitespace bounded."""
    return {"json": schema, "disable_additional_properties": True,
            "whitespace_pattern": CALL_WHITESPACE}


def _calls_schema(tools: list[Tool], parallel: bool) -> dict:
    """A JSON list of calls, each {"name": one of the functions, "parameters": its args}."""
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t.function.name]},
        "parameters": t.function.parameters or _NO_PARAMETERS},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_of(tool_plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output. A forced choice's text is its calls (the
    grammar held it to them), even cut short; a parser's text that does not parse stays
    content."""
    if tool_plan.mode == "named":
        return None, [ToolCall(tool_plan.function, text)]
    if tool_plan.mode == "required":
        calls = CallList(tool_plan.functions)
        calls.feed(text)
        calls.finish()
        return None, calls.calls
    if tool_plan.mode != "auto":
        return text, []
    try:
        return PARSERS[tool_plan.parser](text)
    except (ValueError, KeyError, TypeError):
        return text, []


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for block in text[start:].split("<tool_call>")[1:]:
        body = block.split("</tool_call>")[0].strip()
        calls.append(_call(json.loads(body), "arguments"))
    return text[:start] or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """A JSON object {"name", "parameters"} (after <|python_tag|> when it is kept), or
    several separated by ";"."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        obj, end = decoder.raw_decode(body, pos)
        calls.append(_call(obj, "parameters" if "parameters" in obj else "arguments"))
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return None, calls


def _mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]"""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    calls = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
    calls = calls if isinstance(calls, list) else [calls]
    return text[:start] or None, [_call(c, "arguments") for c in calls]


def _call(obj: dict, args_key: str) -> ToolCall:
    args = obj[args_key]
    return ToolCall(obj["name"], args if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False))


def _in_messages(text: str) -> tuple[str | None, list[ToolCall]]:
    """openai (gpt-oss): calls are harmony messages of their own (harmony.py reads them),
    never in the content."""
    return text, []


PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral,
           "openai": _in_messages}
# Where a parser's calls begin: streamed text before it is content, after it is held back
# (None: the content holds none).
CALL_MARKERS = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]",
                "openai": None}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def tool_call_dicts(calls: list[ToolCall]) -> list[dict]:
    return [{"id": call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
