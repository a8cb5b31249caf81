"""Anthropic's Messages API at the edge, without I/O: its request bodies (POST /v1/messages and
/v1/messages/count_tokens) as typed structs, translated into the chat request the gateway
serves (protocol.py ChatBody), and its error shape. anthropic_api.py answers.

The translation: `system` -> a system message; a user turn's text blocks -> user messages, its
tool_result blocks -> "tool" messages (in their order); an assistant turn's text -> content,
its tool_use blocks -> tool_calls, its thinking blocks dropped (the model's earlier reasoning is
not shown to it again, as the chat templates do); a final assistant turn is a prefill the
answer continues. tools -> function tools; tool_choice auto / any / tool / none -> auto /
required / the named function / none. Unknown fields are a 400, as Anthropic answers them.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from .constraints import JsonSchemaFormat, ResponseFormat
from .protocol import (ApiError, ChatBody, ChatMessageBody, ContentPart, FunctionCallBody,
                       ImageUrl, StreamOptions, ToolCallBody, check_count)
from .tools import FunctionDef, NamedFunction, NamedToolChoice, Tool


# Inside the body, fields pagewire has no use for are ignored (the API grows them often: a
# newer client's block still reads); at the top level an unknown field is a 400.
class _Block(msgspec.Struct, tag_field="type", kw_only=True):
    cache_control: dict | None = None       # prompt caching hints: pagewire caches by prefix


class TextBlock(_Block, tag="text"):
    text: str
    citations: list | None = None


class ImageBlock(_Block, tag="image"):
    source: dict | None = None              # base64 (media_type, data) or url: a chat image part


class DocumentBlock(_Block, tag="document"):
    source: dict | None = None              # refused


class ToolUseBlock(_Block, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str


Block = (TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock |
         ThinkingBlock | RedactedThinkingBlock)


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class CustomTool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] = "custom"
    cache_control: dict | None = None
    strict: bool | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None        # not enforced apart: max_tokens bounds the whole


class Metadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None
    effort: str | None = None               # accepted; the model's own effort is unchanged


class CountTokensBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/messages/count_tokens: what shapes the prompt."""
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None     # each checked by _tools (a clear 400)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # accepted and without effect here: prompt caching is by prefix, one region, one speed
    cache_control: dict | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesBody(CountTokensBody, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/messages."""
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None         # accepted; one tier here
    inference_geo: str | None = None
    diagnostics: dict | None = None
    container: Any = None                   # code execution's container: refused


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(error.status) or ("api_error" if error.status >= 500
                                            else "invalid_request_error")
    message = error.message if error.param is None or error.param in error.message \
        else f"{error.param}: {error.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def to_chat(body: CountTokensBody) -> ChatBody:
    """The chat request a Messages (or count_tokens) body runs as."""
    check_count("messages", body.messages)
    messages = _system(body.system) + chat_turns(body.messages)
    last = body.messages[-1] if body.messages else None
    prefill = last is not None and last.role == "assistant" and not messages[-1].tool_calls
    choice, parallel = _tool_choice(body.tool_choice)
    chat = ChatBody(messages=messages, model=body.model, tools=_tools(body.tools),
                    tool_choice=choice, parallel_tool_calls=parallel,
                    add_generation_prompt=not prefill, continue_final_message=prefill,
                    chat_template_kwargs=_thinking(body.thinking),
                    response_format=_output_format(body.output_config))
    if isinstance(body, MessagesBody):
        if body.container is not None:
            raise ApiError(400, "container: code execution is not supported", "container")
        chat.max_tokens, chat.stop = body.max_tokens, body.stop_sequences
        # the door reads which stop sequence ended the text, and cuts it (anthropic_api.py)
        chat.include_stop_str_in_output = bool(body.stop_sequences)
        chat.temperature, chat.top_p, chat.top_k = body.temperature, body.top_p, body.top_k
        chat.stream = body.stream
        chat.stream_options = StreamOptions(include_usage=True) if body.stream else None
        chat.user = body.metadata.user_id if body.metadata else None
    return chat


def _system(system: str | list[TextBlock] | None) -> list[ChatMessageBody]:
    if isinstance(system, list):
        check_count("content", system, "system")
        system = "\n".join(block.text for block in system)
    return [ChatMessageBody(role="system", content=system)] if system else []


def chat_turns(messages: list[InputMessage]) -> list[ChatMessageBody]:
    out: list[ChatMessageBody] = []
    for index, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append(ChatMessageBody(role=m.role, content=m.content))
            continue
        check_count("content", m.content, "messages")
        turn = {"assistant": _assistant_turn, "system": _system_turn}.get(m.role, _user_turn)
        out += turn(m.content, f"messages[{index}]")
    return out


def _system_turn(blocks: list, where: str) -> list[ChatMessageBody]:
    for block in blocks:
        if not isinstance(block, TextBlock):
            _refuse(block, where, "a system")
    return [ChatMessageBody(role="system", content="".join(b.text for b in blocks))]


def _user_turn(blocks: list, where: str) -> list[ChatMessageBody]:
    """Text and image blocks as user messages, each tool_result as a tool message, in their
    order."""
    out, parts = [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append(ContentPart(type="text", text=block.text))
        elif isinstance(block, ImageBlock):
            parts.append(ContentPart(type="image_url",
                                     image_url=ImageUrl(url=_image_url(block, where))))
        elif isinstance(block, ToolResultBlock):
            if parts:
                out.append(_user_message(parts))
                parts = []
            out.append(ChatMessageBody(role="tool", tool_call_id=block.tool_use_id,
                                       content=_result_text(block, where)))
        else:
            _refuse(block, where, "a user")
    if parts or not out:
        out.append(_user_message(parts))
    return out


def _user_message(parts: list[ContentPart]) -> ChatMessageBody:
    """Text alone as a string (as before images); with images, the parts in order."""
    if all(p.type == "text" for p in parts):
        return ChatMessageBody(role="user", content="".join(p.text for p in parts))
    return ChatMessageBody(role="user", content=parts)


def _image_url(block: ImageBlock, where: str) -> str:
    """An image block's source as the URL a chat image part takes."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError(400, f"{where}: an image's source must be base64 or url")


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if isinstance(content, list):
        check_count("content", content, "messages")
        for part in content:
            if not isinstance(part, TextBlock):
                _refuse(part, where, "a tool_result")
        content = "".join(part.text for part in content)
    return ("Error: " if block.is_error else "") + (content or "")


def _assistant_turn(blocks: list, where: str) -> list[ChatMessageBody]:
    text, calls = [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCallBody(id=block.id, function=FunctionCallBody(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            _refuse(block, where, "an assistant")
    return [ChatMessageBody(role="assistant", content="".join(text) if text else None,
                            tool_calls=calls or None)]


def _refuse(block, where: str, holder: str):
    kind = type(block).__struct_config__.tag
    if isinstance(block, DocumentBlock):
        raise ApiError(400, f"{where}: {kind} content is not supported yet (text only)")
    raise ApiError(400, f"{where}: {holder} message cannot hold {kind} blocks")


def _tools(raw: list[dict] | None) -> list[Tool] | None:
    """Custom tools as function tools. Anthropic's server tools (web search, code execution,
    computer use, ...) run at Anthropic, not here: a 400 naming the type."""
    if raw is None:
        return None
    check_count("tools", raw)
    out = []
    for index, entry in enumerate(raw):
        kind = entry.get("type", "custom")
        if kind != "custom":
            raise ApiError(400, f"tools[{index}]: tool type {kind!r} is not supported (custom "
                           "tools only)", "tools")
        try:
            tool = msgspec.convert(entry, CustomTool)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"tools[{index}]: {e}", "tools") from None
        out.append(Tool(function=FunctionDef(name=tool.name, description=tool.description,
                                             parameters=tool.input_schema, strict=tool.strict)))
    return out


def _tool_choice(choice: ToolChoice | None) -> tuple[str | NamedToolChoice | None, bool]:
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice of type tool needs a name", "tool_choice")
        return NamedToolChoice(function=NamedFunction(name=choice.name)), parallel
    return {"any": "required"}.get(choice.type, choice.type), parallel


def _thinking(thinking: Thinking | None) -> dict | None:
    """thinking on or off as the common chat templates read it (Qwen3's enable_thinking);
    adaptive leaves the template's default."""
    if thinking is None or thinking.type == "adaptive":
        return None
    return {"enable_thinking": thinking.type == "enabled"}


def _output_format(config: OutputConfig | None) -> ResponseFormat | None:
    if config is None or config.format is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="output", schema=config.format.schema))
