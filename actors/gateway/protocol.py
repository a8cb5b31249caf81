"""The OpenAI protocol: request bodies as typed structs, their validation into SamplingParams,
and the response and stream-chunk shapes. No I/O here."""
from __future__ import annotations

import msgspec

from pagewire.wire.sampling import InvalidParam, SamplingParams
from pagewire.wire.to_tokenizer import ChatMessage

MAX_N = 16


class ApiError(Exception):
    """Answered as OpenAI error JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
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


class _Common(msgspec.Struct, kw_only=True):
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
    # Accepted by OpenAI but not implemented yet: refused when set, never silently ignored.
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[str | int | list[int]]
    echo: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageBody(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# Field -> the values that mean "off" (accepted, as clients often send them explicitly).
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0),
                "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
                "repetition_penalty": (None, 1.0), "logit_bias": (None, {})}


def decode_body(raw: bytes, body_type: type) -> msgspec.Struct:
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None


def to_sampling(body: _Common, max_tokens: int | None) -> SamplingParams:
    """The request's SamplingParams (shared by each of its prompts)."""
    for name, neutral in _UNSUPPORTED.items():
        if getattr(body, name) not in neutral:
            raise ApiError(400, f"`{name}` is not supported yet", name)
    if not 1 <= body.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {body.n}", "n")
    if body.best_of is not None and not body.n <= body.best_of <= MAX_N:
        raise ApiError(400, f"best_of must be between n and {MAX_N}, got {body.best_of}", "best_of")
    fields = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                  min_p=body.min_p, seed=body.seed)
    try:
        return SamplingParams(
            **{k: v for k, v in fields.items() if v is not None},
            n=body.n, best_of=body.best_of, use_beam_search=body.use_beam_search,
            length_penalty=body.length_penalty, max_tokens=max_tokens, min_tokens=body.min_tokens,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens)
    except InvalidParam as e:
        raise ApiError(400, str(e), e.param) from None


def completion_prompts(body: CompletionBody) -> list[dict]:
    """Normalize `prompt` to a list of {"prompt": str} or {"prompt_token_ids": [...]}."""
    p = body.prompt
    if isinstance(p, str):
        return [{"prompt": p}]
    if not p:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": list(p)}]
    if all(isinstance(x, str) for x in p):
        return [{"prompt": x} for x in p]
    if all(isinstance(x, list) for x in p):
        return [{"prompt_token_ids": x} for x in p]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                   "list of token-id lists", "prompt")


def chat_messages(body: ChatBody) -> list[ChatMessage]:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ApiError(400, "only text content parts are supported", "messages")
            content = "".join(part.text or "" for part in content)
        out.append(ChatMessage(role=m.role, content=content, name=m.name))
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Response shapes for one endpoint. `chat` picks chat.completion vs text_completion."""

    def __init__(self, chat: bool, req_id: str, created: int, model: str):
        self.chat, self.id, self.created, self.model = chat, req_id, created, model

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, texts: dict[int, str], reasons: dict[int, str], use: dict) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                        "logprobs": None, "finish_reason": reasons[i]} for i in sorted(texts)]
            out = self._envelope("chat.completion", choices)
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": None,
                        "finish_reason": reasons[i]} for i in sorted(texts)]
            out = self._envelope("text_completion", choices)
        out["usage"] = use
        return out

    def chunk(self, index: int, text: str | None, finish_reason: str | None,
              role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, use: dict) -> dict:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = use
        return out
