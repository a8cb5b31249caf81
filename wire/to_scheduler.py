"""Messages the scheduler receives: requests from tokenizers, aborts from the gateway and the
detokenizer, step results from executor rank 0."""
from __future__ import annotations

import msgspec

from .sampling import SamplingParams


class NewRequest(msgspec.Struct, tag=True, kw_only=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float


class Abort(msgspec.Struct, tag=True):
    """Stop these requests and free their blocks. Unknown ids are ignored (the request may have
    finished already, or not reached the scheduler yet)."""
    req_ids: list[str]


class StepResult(msgspec.Struct, tag=True, gc=False):
    """What one step produced: the token sampled for each request whose computed tokens reached
    the end of its known tokens, in plan order. `error` is set when the step failed as a whole."""
    step_id: int
    req_ids: list[str]
    token_ids: list[int]
    error: str | None = None


SchedulerInbox = NewRequest | Abort | StepResult
