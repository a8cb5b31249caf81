"""Messages the scheduler receives: requests from tokenizers, aborts from the gateway and the
detokenizer, step results from executor rank 0."""
from __future__ import annotations

import msgspec

from .sampling import LogprobsChunk, SamplingParams


class NewRequest(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """One prompt. With sampling.num_sequences > 1 the scheduler forks it into sequences
    named by output_ids() once the prompt is computed."""
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0


class Abort(msgspec.Struct, tag=True):
    """Stop these requests and free their blocks. Unknown ids are ignored (the request may have
    finished already, or not reached the scheduler yet)."""
    req_ids: list[str]


class StepResult(msgspec.Struct, tag=True, gc=False):
    """What one step produced, one row per request whose computed tokens reached the end of
    its known tokens: the token sampled (the most likely one for beam search, which appends
    nothing itself). `logprobs` (the sampled token's log-probability) and `top_ids` /
    `top_logprobs` (the k most likely tokens, k per request) are set only when some row asked;
    rows that did not ask hold 0.0 and []. `error` is set when the step failed as a whole."""
    step_id: int
    req_ids: list[str]
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: dict[str, LogprobsChunk] | None = None   # by request: this step's prompt
    error: str | None = None                                  # positions (token 1 onward)


class AbortAll(msgspec.Struct, tag=True):
    """From the supervisor when the gateway was restarted: its clients are gone, so end every
    request (each still gets its final "abort" delta)."""
    reason: str


SchedulerInbox = NewRequest | Abort | StepResult | AbortAll
