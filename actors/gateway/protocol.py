"""The OpenAI protocol's requests: bodies as typed structs and their validation into
SamplingParams (responses.py shapes the answers). No I/O here."""
from __future__ import annotations

import json

import msgspec

from pagewire.wire.sampling_params import InvalidParam, SamplingParams
from pagewire.wire.to_tokenizer import ChatMessage

from .constraints import ConstraintFields, constraint, requested_constraints
from .tools import NamedToolChoice, Tool

MAX_N = 16


class ApiError(Exception):
    """Answered as OpenAI error JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             409: "ConflictError", 413: "RequestTooLargeError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.error_type = error_type or self.TYPES.get(status, "BadRequestError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.status}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(ConstraintFields, kw_only=True):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI clients send extras."""
    model: str | None = None
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM)
    kv_transfer_params: dict | None = None   # disaggregated prefill/decode (disagg.py)
    kv_compress_rate: float | None = None    # KV-Compress: this request's share of KV kept


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[str | int | list[int]]
    echo: bool = False
    logprobs: int | None = None          # the top k alternatives (and the sampled token's)
    request_id: str | None = None        # names a streamed prompt's session (stream_input.py)
    stream_input: bool = False           # the prompt continues in pieces (stream_input.py)


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCallBody(msgspec.Struct, kw_only=True):
    name: str
    arguments: str                 # JSON text, as OpenAI sends it


class ToolCallBody(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCallBody


class ChatMessageBody(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None                  # a tool message answers this call


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, bool | int | float | str | None] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


MAX_LOGPROBS = 20
# chat_template_kwargs a client may set: switches the common templates read, nothing that
# reaches into the template's code paths (tools, documents, custom templates).
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "add_generation_prompt",
                                  "reasoning_effort"})


# Caps on what one request may list (a 400 names the field): each entry costs work in every
# step the request runs (stop strings are searched in each new text, logit_bias entries
# applied to each row of logits, tools rendered and compiled into a constraint), so a client
# may not ask for unbounded amounts. vLLM caps none of these; OpenAI documents up to 4 stop
# strings and 128 tools. docs/api.md "Request limits" lists them.
LIST_CAPS = {"stop": 64, "stop_token_ids": 1024, "bad_words": 256, "logit_bias": 1024,
             "allowed_token_ids": 262144, "messages": 4096, "content": 256, "prompt": 1024,
             "tools": 128}
MAX_STOP_CHARS = 1024          # one stop string or bad word, in characters


def decode_body(raw: bytes, body_type: type) -> msgspec.Struct:
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except UnicodeDecodeError as e:      # a JSON string's bytes are not UTF-8
        raise ApiError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}") \
            from None


def check_count(name: str, items, param: str | None = None) -> None:
    """A 400 if the list (or mapping) `items` holds more than LIST_CAPS[name] entries."""
    if items is not None and not isinstance(items, str) and len(items) > LIST_CAPS[name]:
        raise ApiError(400, f"{name} may hold at most {LIST_CAPS[name]} entries, got "
                       f"{len(items)}", param or name)


def to_sampling(body: _Common, max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None, extra_constraints=()) -> SamplingParams:
    """The request's SamplingParams (shared by each of its prompts). `extra_constraints`:
    what else asks for one (tool choice), as requested_constraints() lists them."""
    _check_caps(body, logprobs, prompt_logprobs)
    optional = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    min_p=body.min_p, seed=body.seed, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty)
    try:
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()} or None
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids", "logit_bias") from None
    try:
        structured = constraint(requested_constraints(body) + list(extra_constraints))
        return SamplingParams(
            **{k: v for k, v in optional.items() if v is not None},
            n=body.n, best_of=body.best_of, use_beam_search=body.use_beam_search,
            length_penalty=body.length_penalty, max_tokens=max_tokens, min_tokens=body.min_tokens,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=bias,
            allowed_token_ids=body.allowed_token_ids, bad_words=list(body.bad_words or []),
            truncate_prompt_tokens=body.truncate_prompt_tokens, structured_outputs=structured,
            kv_compress_rate=body.kv_compress_rate)
    except InvalidParam as e:
        raise ApiError(400, str(e), e.param) from None


def _check_caps(body: _Common, logprobs: int | None, prompt_logprobs: int | None) -> None:
    """Server-side limits, each a 400 naming its field."""
    if not 1 <= body.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {body.n}", "n")
    if body.best_of is not None and not body.n <= body.best_of <= MAX_N:
        raise ApiError(400, f"best_of must be between n and {MAX_N}, got {body.best_of}", "best_of")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ApiError(400, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
    for name in ("stop", "stop_token_ids", "bad_words", "logit_bias", "allowed_token_ids"):
        check_count(name, getattr(body, name))
    for name in ("stop", "bad_words"):
        value = getattr(body, name)
        strings = [value] if isinstance(value, str) else value or []
        if any(len(text) > MAX_STOP_CHARS for text in strings):
            raise ApiError(400, f"each of {name} may be at most {MAX_STOP_CHARS} characters",
                           name)


def chat_logprobs(body: ChatBody) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def template_kwargs(body: ChatBody) -> dict:
    kwargs = body.chat_template_kwargs or {}
    refused = sorted(set(kwargs) - CHAT_TEMPLATE_KWARGS)
    if refused:
        raise ApiError(400, f"chat_template_kwargs {refused} are not allowed (allowed: "
                       f"{sorted(CHAT_TEMPLATE_KWARGS)})", "chat_template_kwargs")
    return kwargs


def completion_prompts(body: CompletionBody) -> list[dict]:
    """Normalize `prompt` to a list of {"prompt": str} or {"prompt_token_ids": [...]}."""
    p = body.prompt
    if isinstance(p, str):
        return [{"prompt": p}]
    if not p:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": list(p)}]
    check_count("prompt", p)
    if all(isinstance(x, str) for x in p):
        return [{"prompt": x} for x in p]
    if all(isinstance(x, list) for x in p):
        return [{"prompt_token_ids": x} for x in p]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                   "list of token-id lists", "prompt")


def chat_messages(body: ChatBody) -> list[ChatMessage]:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    check_count("messages", body.messages)
    out = []
    for m in body.messages:
        content, slots = m.content, None
        if isinstance(content, list):
            content, slots = _joined_parts(content)
        out.append(ChatMessage(role=m.role, content=content, name=m.name,
                               tool_calls=_template_calls(m.tool_calls),
                               tool_call_id=m.tool_call_id, image_slots=slots))
    return out


def _joined_parts(parts: list[ContentPart]) -> tuple[str, list[int] | None]:
    """Text parts joined; each image part's place in that text."""
    check_count("content", parts, "messages")
    text, slots = "", []
    for part in parts:
        if part.type == "text":
            text += part.text or ""
        elif part.type == "image_url" and part.image_url is not None:
            slots.append(len(text))
        else:
            raise ApiError(400, f"content part type {part.type!r} is not supported (text, "
                           f"image_url)", "messages")
    return text, slots or None


def chat_images(body: ChatBody) -> list[str]:
    """The URLs of the messages' image parts, in order."""
    return [part.image_url.url for m in body.messages if isinstance(m.content, list)
            for part in m.content if part.type == "image_url" and part.image_url is not None]


def _template_calls(calls: list[ToolCallBody] | None) -> list[dict] | None:
    """Earlier tool calls as chat templates read them: arguments as an object (Hermes, Qwen
    and Llama templates render them with tojson), the text kept where it is not JSON."""
    if not calls:
        return None
    out = []
    for c in calls:
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": c.type,
                    "function": {"name": c.function.name, "arguments": args}})
    return out
