"""Messages the scheduler receives: requests from tokenizers, aborts from the gateway and the
detokenizer, step results from executor rank 0."""
from __future__ import annotations

import msgspec

from .ids import SeqId
from .kv_transfer import KvLeaseEnded, KvPulled, KvTransfer
from .lora import LoraRef
from .sampling_params import LogprobsChunk, SamplingParams


class NewRequest(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """One prompt. With sampling.num_sequences > 1 the scheduler forks it into its output
    sequences (ids.output_ids) once the prompt is computed."""
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0
    lora: LoraRef | None = None
    kv_transfer: KvTransfer | None = None     # disaggregated prefill/decode (kv_transfer.py)
    prompt_open: bool = False    # more of the prompt comes in PromptPieces (streaming input)


class PromptPiece(msgspec.Struct, tag=True):
    """More of an open prompt (NewRequest.prompt_open), in arrival order; `last` closes it and
    generation starts. A piece for a request that ended (aborted, failed) is ignored."""
    req_id: str
    token_ids: list[int]
    last: bool = False


class Abort(msgspec.Struct, tag=True):
    """Stop these output sequences and free their blocks; aborting one output of a beam search,
    or of a prompt not yet forked, stops the whole request. Unknown ids are remembered a while
    (the request may not have reached the scheduler yet) and otherwise ignored."""
    seq_ids: list[SeqId]


class StepResult(msgspec.Struct, tag=True, gc=False):
    """What one step produced, one row per sequence whose computed tokens reached the end of
    its known tokens: the token sampled (the most likely one for beam search, which appends
    nothing itself). `logprobs` (the sampled token's log-probability) and `top_ids` /
    `top_logprobs` (the k most likely tokens, k per sequence) are set only when some row asked;
    rows that did not ask hold 0.0 and []. `prompt_logprobs`: this step's prompt positions
    (token 1 onward), by sequence. `error` is set when the step failed as a whole; `errors`
    names sequences that failed alone (a token their grammar refused): their rows' tokens are
    not theirs to append. Speculative decoding: `extra_token_ids` holds the tokens a row
    produced after its first (drafts verified, then the first token that differed), and
    `num_drafts` how many draft tokens the executor now holds for a sequence;
    `extra_logprobs` the extra tokens' log-probabilities where logprobs were asked.
    `kv_loaded`: of each KvLoad in the plan's tier work, how many leading blocks arrived
    whole (on every rank); the rest are to be computed. `head_lens`: KV-Compress, the tokens
    each head row (layer x KV head) of a sequence compressed after this step now holds."""
    step_id: int
    seq_ids: list[SeqId]
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: dict[SeqId, LogprobsChunk] | None = None
    error: str | None = None
    errors: dict[SeqId, str] | None = None
    extra_token_ids: dict[SeqId, list[int]] | None = None
    extra_logprobs: dict[SeqId, LogprobsChunk] | None = None   # theirs, when rows asked
    num_drafts: dict[SeqId, int] | None = None
    kv_loaded: dict[SeqId, int] | None = None
    head_lens: dict[SeqId, list[int]] | None = None


class AbortAll(msgspec.Struct, tag=True):
    """From the supervisor when the gateway was restarted: its clients are gone, so end every
    request (each still gets its final "abort" delta)."""
    reason: str


SchedulerInbox = (NewRequest | PromptPiece | Abort | StepResult | AbortAll | KvLeaseEnded
                  | KvPulled)
