"""Ollama's API at the edge: the bodies of /api/chat and /api/generate, translated into the
OpenAI chat and completions requests the gateway already serves (protocol.py), so tools,
structured outputs, reasoning, logprobs, caps, aborts and metrics are the same code whichever
API a request came in by. ollama_door.py shapes the answers back, ollama_routes.py holds the
routes. No I/O here.

Decisions where Ollama's model does not map one to one (docs/api.md "Ollama"):
- /api/generate with `raw` false puts the prompt (after `system`) through the model's chat
  template, as Ollama does, so it becomes a chat request; `raw` true is a completion of the
  prompt as it stands. `template`, `suffix` and `context` are 400s (the chat template is the
  server's; no fill-in-the-middle, no token context). `images` (base64) are chat image parts
  ahead of the message's text, for a vision model (a raw prompt cannot place them: a 400).
- Ollama's options that tune llama.cpp's runtime (num_gpu, num_thread, mirostat, ...) are
  ignored, as Ollama ignores options it does not know. num_ctx cannot resize the server's
  context (--max-model-len): one below it keeps the prompt's last num_ctx tokens.
- num_predict -1 or -2 (Ollama's "no limit" and "fill the context") and no num_predict
  generate up to the context, Ollama's default; a negative seed is a random one.
"""
from __future__ import annotations

import json

import msgspec

from .constraints import JsonSchemaFormat, ResponseFormat
from .protocol import (ApiError, ChatBody, ChatMessageBody, CompletionBody, ContentPart,
                       FunctionCallBody, ImageUrl, ToolCallBody)
from .tools import Tool

THINK_LEVELS = ("high", "medium", "low")     # gpt-oss's reasoning efforts, as Ollama names them


class Options(msgspec.Struct, kw_only=True):
    """The sampling part of Ollama's options; other keys are ignored (unknown fields)."""
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    num_ctx: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class OllamaFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict = {}                 # an object, where OpenAI sends JSON text


class OllamaToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    thinking: str | None = None          # an earlier answer's reasoning: not sent back
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None         # a tool message: the function that answered
    tool_call_id: str | None = None


class _Request(msgspec.Struct, kw_only=True):
    """Fields both endpoints share. Ollama streams unless told not to."""
    model: str
    stream: bool = True
    format: str | dict | None = None
    options: Options | None = None
    keep_alive: str | int | float | None = None    # the model never unloads: accepted, unused
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class ChatRequest(_Request, kw_only=True):
    messages: list[OllamaMessage] = []
    tools: list[Tool] | None = None


class GenerateRequest(_Request, kw_only=True):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


def model_name(model: str) -> str:
    """The served name a request's `model` means: Ollama's clients add the default tag."""
    return model.removesuffix(":latest")


def chat_body(req: ChatRequest, max_model_len: int, reasoning_parser: str | None) -> ChatBody:
    """The OpenAI chat request /api/chat's body asks for."""
    return ChatBody(model=model_name(req.model), messages=[_message(m) for m in req.messages],
                    tools=req.tools or None, **_common(req, max_model_len, reasoning_parser))


def generate_body(req: GenerateRequest, max_model_len: int,
                  reasoning_parser: str | None) -> ChatBody | CompletionBody:
    """/api/generate's body: a chat request of the system and the prompt (Ollama applies the
    chat template unless `raw`), or a completion of the raw prompt."""
    for name in ("suffix", "template", "context"):
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported (pagewire applies the model's own "
                           "chat template; no fill-in-the-middle or token context)", name)
    if req.raw and req.images:
        raise ApiError(400, "images need the chat template (raw is false)", "images")
    common = _common(req, max_model_len, reasoning_parser)
    if req.raw:
        common.pop("logprobs"), common.pop("top_logprobs"), common.pop("chat_template_kwargs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return CompletionBody(model=model_name(req.model), prompt=req.prompt, logprobs=logprobs,
                              **common)
    messages = [ChatMessageBody(role="system", content=req.system)] if req.system else []
    messages.append(ChatMessageBody(role="user", content=_with_images(req.prompt, req.images)))
    return ChatBody(model=model_name(req.model), messages=messages, **common)


def _common(req: _Request, max_model_len: int, reasoning_parser: str | None) -> dict:
    return dict(stream=req.stream, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
                chat_template_kwargs=_think(req.think, req.model, reasoning_parser),
                **sampling_fields(req.options or Options(), max_model_len),
                **format_fields(req.format))


def sampling_fields(opts: Options, max_model_len: int) -> dict:
    """The OpenAI (and vLLM) request fields Ollama's options mean."""
    if opts.num_predict is not None and (opts.num_predict == 0 or opts.num_predict < -2):
        raise ApiError(400, "options.num_predict must be -1, -2 or positive, got "
                       f"{opts.num_predict}", "options.num_predict")
    if opts.num_ctx is not None and opts.num_ctx < 1:
        raise ApiError(400, f"options.num_ctx must be positive, got {opts.num_ctx}",
                       "options.num_ctx")
    fields = dict(temperature=opts.temperature, top_p=opts.top_p, min_p=opts.min_p,
                  presence_penalty=opts.presence_penalty,
                  frequency_penalty=opts.frequency_penalty,
                  repetition_penalty=opts.repeat_penalty, stop=opts.stop,
                  top_k=None if opts.top_k is None else max(opts.top_k, 0),  # <= 0: no cut
                  seed=opts.seed if opts.seed is not None and opts.seed >= 0 else None,
                  max_tokens=opts.num_predict if (opts.num_predict or 0) > 0 else None,
                  truncate_prompt_tokens=opts.num_ctx
                  if opts.num_ctx is not None and opts.num_ctx < max_model_len else None)
    return {k: v for k, v in fields.items() if v is not None}


def format_fields(fmt: str | dict | None) -> dict:
    """`format`: "json" is any JSON object, a schema is that schema."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": ResponseFormat(type="json_object")}
    if isinstance(fmt, dict):
        return {"response_format": ResponseFormat(type="json_schema",
                                                  json_schema=JsonSchemaFormat(schema=fmt))}
    raise ApiError(400, f'invalid format: expected "json" or a JSON schema, got {fmt!r}',
                   "format")


def _think(think: bool | str | None, model: str, parser: str | None) -> dict | None:
    """`think` as the chat templates read it (Qwen3: enable_thinking; gpt-oss: an effort).
    Thinking needs a server started with --reasoning-parser, which sets `thinking` apart."""
    if think is None or think is False and parser is None:
        return None
    if parser is None:
        raise ApiError(400, f'"{model}" does not support thinking (start the server with '
                       "--reasoning-parser)", "think")
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think not in THINK_LEVELS:
        raise ApiError(400, f"think must be true, false or one of {', '.join(THINK_LEVELS)}, "
                       f"got {think!r}", "think")
    return {"reasoning_effort": think}


def _with_images(text: str, images: list[str] | None) -> str | list[ContentPart]:
    """Ollama's images (base64, no data: prefix) as chat image parts ahead of the text, where
    Ollama puts them."""
    if not images:
        return text
    parts = [ContentPart(type="image_url", image_url=ImageUrl(url="data:image;base64," + data))
             for data in images]
    return parts + [ContentPart(type="text", text=text)]


def _message(m: OllamaMessage) -> ChatMessageBody:
    calls = [ToolCallBody(id=c.id, function=FunctionCallBody(
        name=c.function.name, arguments=json.dumps(c.function.arguments, ensure_ascii=False)))
        for c in m.tool_calls] if m.tool_calls else None
    return ChatMessageBody(role=m.role, content=_with_images(m.content, m.images),
                           name=m.tool_name, tool_calls=calls,
                           tool_call_id=m.tool_call_id)
