"""Messages the detokenizer receives: request setup from a tokenizer, token deltas from the
scheduler."""
from __future__ import annotations

import msgspec

from .ids import SeqId
from .sampling_params import LogprobsChunk


class DetokStart(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Sent by the tokenizer before the request reaches the scheduler. Deltas for a request the
    detokenizer has not seen yet are held until this arrives."""
    req_id: str
    prompt_tail: list[int]           # last prompt tokens, to prime the incremental decoder
    num_prompt_tokens: int
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0              # stop strings are ignored before this many outputs
    num_outputs: int = 1             # output sequences: ids.output_ids(req_id, num_outputs)
    echo_prompt: str | None = None   # the prompt's text, sent ahead of the output (echo)
    first_prompt_token: int | None = None   # heads the prompt logprobs, when asked


class PromptGrew(msgspec.Struct, tag=True):
    """A streamed prompt's piece arrived (from the tokenizer that sent its DetokStart, after
    it): `num_tokens` more prompt tokens, for the usage the gateway reports."""
    req_id: str
    num_tokens: int


class TokenDelta(msgspec.Struct, array_like=True, gc=False):
    seq_id: SeqId                      # an output sequence
    token_ids: list[int]
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | "rejected"
    error: str | None = None
    cumulative_logprob: float | None = None   # on the final delta, when it was computed
    logprobs: LogprobsChunk | None = None     # of token_ids, when asked
    prompt_logprobs: LogprobsChunk | None = None
    pooled: bytes | None = None       # a pooling request's output, float32 (pooling.py)


class TokenDeltas(msgspec.Struct, tag=True, gc=False):
    deltas: list[TokenDelta]


DetokenizerInbox = DetokStart | PromptGrew | TokenDeltas
