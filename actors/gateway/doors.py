"""The APIs a client may speak, each a door onto one request path.

A door's route translates its body into the OpenAI chat or completions request the gateway
already serves (protocol.py ChatBody, CompletionBody), so tools, structured outputs, reasoning,
logprobs, usage, aborts on disconnect, API keys and the request caps behave alike whichever door
a request came in by. Its Door object translates the answers back: the whole answer (the OpenAI
dict Formatter.full makes) and, for a stream, the bytes each OpenAI chunk becomes, with the
API's own framing (SSE with or without event names, newline-delimited JSON) and its own error
shape. No I/O here: server.py writes what a door returns.
"""
from __future__ import annotations

import msgspec

from .protocol import ApiError
from .responses import Formatter

_json = msgspec.json.Encoder()


def sse(obj: dict, event: str | None = None) -> bytes:
    """One server-sent event: `data: JSON` (after `event: NAME` where the API names events)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + _json.encode(obj) + b"\n\n"


def ndjson(obj: dict) -> bytes:
    return _json.encode(obj) + b"\n"


def chunk_choice(chunk: dict) -> dict | None:
    """An OpenAI chat stream chunk's one choice; None for the usage chunk (a door reports
    usage from closing())."""
    return chunk["choices"][0] if chunk["choices"] else None


class Door:
    """OpenAI's own chat and completions (the shapes the Formatter makes, unchanged). Other
    APIs subclass it and override what differs. `name` labels the request metrics."""

    name = "openai"
    content_type = "text/event-stream"

    def __init__(self, fmt: Formatter, include_usage: bool = False):
        self.fmt, self.include_usage = fmt, include_usage

    def full(self, answer: dict) -> dict:
        """The whole answer (non-streamed), from the OpenAI dict."""
        return answer

    def started(self, usage: dict) -> None:
        """Every prompt has its first reply (the prefill is over; `usage` counts the prompt's
        tokens), streamed or not, before a stream's opening: a door that reports the prompt's
        tokens up front (Anthropic's) or durations (Ollama's) notes them."""

    def opening(self, num_choices: int) -> list[bytes]:
        """What a stream sends before the first delta."""
        if not self.fmt.chat:
            return []
        return [sse(self.fmt.role_chunk(index)) for index in range(num_choices)]

    def events(self, chunk: dict) -> list[bytes]:
        """What one OpenAI stream chunk (Formatter.chunks) becomes."""
        return [sse(chunk)]

    def closing(self, usage: dict) -> list[bytes]:
        """What a stream sends after its last delta."""
        tail = [sse(self.fmt.usage_chunk(usage))] if self.include_usage else []
        return tail + [b"data: [DONE]\n\n"]

    def failed(self, error: ApiError) -> list[bytes]:
        """The engine failed mid-stream: an error event, then the stream's end."""
        return [sse(error.body()), b"data: [DONE]\n\n"]

    @staticmethod
    def error_body(error: ApiError) -> dict:
        """An HTTP error on this door's routes, in the API's own shape."""
        return error.body()
