"""Messages the detokenizer receives: request setup from a tokenizer, token deltas from the
scheduler, and the scheduler's record of every request after the detokenizer (re)started."""
from __future__ import annotations

import msgspec

from .ids import SeqId
from .sampling_params import LogprobsChunk, SamplingParams

PROMPT_TAIL = 6   # prompt tokens that prime the incremental detokenizer


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


def detok_start(req_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                pooled: bool = False, echo_prompt: str | None = None) -> DetokStart:
    """A request's DetokStart from its prompt and sampling: the tokenizer's, and the one the
    scheduler rebuilds for a restarted detokenizer (DetokResync), so the two never differ."""
    if pooled:
        return DetokStart(req_id=req_id, prompt_tail=[], num_prompt_tokens=len(prompt_token_ids))
    s = sampling
    return DetokStart(req_id=req_id, prompt_tail=prompt_token_ids[-PROMPT_TAIL:],
                      num_prompt_tokens=len(prompt_token_ids), stop=s.stop,
                      include_stop_str_in_output=s.include_stop_str_in_output,
                      skip_special_tokens=s.skip_special_tokens, min_tokens=s.min_tokens,
                      num_outputs=s.num_outputs, echo_prompt=echo_prompt,
                      first_prompt_token=prompt_token_ids[0]
                      if s.prompt_logprobs is not None else None)


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


class OutputTokens(msgspec.Struct, array_like=True, gc=False):
    """One output sequence as the scheduler sent it so far: every token, and how it ended
    (a pooling request's vector with it)."""
    seq_id: SeqId
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    pooled: bytes | None = None


class DetokResync(msgspec.Struct, tag=True, gc=False):
    """From the scheduler, answering a detokenizer's DetokenizerStarted: the start of every
    request it holds or ended lately (scheduler: detok_record.py) and every output's tokens.
    Everything the scheduler sent before this precedes it on the one socket, so it supersedes
    any delta of these outputs received earlier. Each output's text is rebuilt from its first
    token and sent whole (TextDelta.from_start): the gateway drops what it already has."""
    starts: list[DetokStart]
    outputs: list[OutputTokens]


DetokenizerInbox = DetokStart | PromptGrew | TokenDeltas | DetokResync
