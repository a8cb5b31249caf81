"""Messages the gateway receives: text from the detokenizer, refusals from tokenizers."""
from __future__ import annotations

import msgspec


class TextDelta(msgspec.Struct, array_like=True, gc=False):
    req_id: str
    text: str
    num_prompt_tokens: int
    num_output_tokens: int              # outputs so far, this delta's included
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error" | "rejected"
    error: str | None = None
    cumulative_logprob: float | None = None


class TextDeltas(msgspec.Struct, tag=True, gc=False):
    deltas: list[TextDelta]


class RequestFailed(msgspec.Struct, tag=True, kw_only=True):
    """A request refused before it reached the scheduler (bad prompt, too long, ...)."""
    req_id: str
    status: int                  # HTTP status the gateway answers with
    message: str
    error_type: str = "BadRequestError"
    param: str | None = None


GatewayInbox = TextDeltas | RequestFailed
