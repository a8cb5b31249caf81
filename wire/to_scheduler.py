"""Messages the scheduler receives: requests from tokenizers, aborts from the gateway and the
detokenizer, step results from executor rank 0, a (re)started detokenizer's hello."""
from __future__ import annotations

import msgspec

from .engine_control import ControlDone, SleepEngine, UpdateWeights, WakeEngine
from .ids import SeqId
from .kv_transfer import KvLeaseEnded, KvPulled, KvTransfer
from .lora import LoraRef
from .multimodal import ImageInput
from .pooling import PooledResult, PoolingSeq
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
    images: list[ImageInput] = []   # the prompt's images, preprocessed (multimodal.py)
    pooling: PoolingSeq | None = None   # a prompt read, not continued (pooling.py)


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


class SampledLogprobs(msgspec.Struct, array_like=True, gc=False):
    """StepResult section: log-probabilities of each row's sampled token (`logprobs`) and the
    k most likely tokens there (`top_ids` / `top_logprobs`, k per sequence), by row. Present
    when some row asked; rows that did not ask hold 0.0 and []. Read by the scheduler's
    _append (speculation.py DraftPolicy.logprobs_of) and by beam search (its candidates)."""
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class PromptLogprobsResult(msgspec.Struct, array_like=True, gc=False):
    """StepResult section: this step's prompt positions' log-probabilities (token 1 onward),
    by sequence (scheduler: request.py Request.prompt_logprob_deltas)."""
    chunks: dict[SeqId, LogprobsChunk]


class DraftsResult(msgspec.Struct, array_like=True, gc=False):
    """StepResult section, speculative decoding (scheduler: speculation.py DraftPolicy):
    `extra_token_ids` the tokens a row produced after its first (drafts verified, then the
    first token that differed); `extra_logprobs` their log-probabilities where logprobs were
    asked; `num_drafts` how many draft tokens the executor now holds for a sequence. A map
    holds only the sequences it concerns (empty when none)."""
    extra_token_ids: dict[SeqId, list[int]]
    extra_logprobs: dict[SeqId, LogprobsChunk]
    num_drafts: dict[SeqId, int]


class TierResult(msgspec.Struct, array_like=True, gc=False):
    """StepResult section, the disk tier (scheduler: arrivals.py tier_loaded): of each KvLoad
    in the plan's tier work, how many leading blocks arrived whole (on every rank); the rest
    are to be computed."""
    kv_loaded: dict[SeqId, int]


class CompressResult(msgspec.Struct, array_like=True, gc=False):
    """StepResult section, KV-Compress (scheduler: head_tables.py CompressedTables): the
    tokens each head row (layer x KV head) of a sequence compressed after this step holds."""
    head_lens: dict[SeqId, list[int]]


class EncoderResult(msgspec.Struct, array_like=True, gc=False):
    """StepResult section, a vision model's encoder (executor/image_rows.py): the images this
    step's rows read, of those found in the encoder cache, and the seconds encoding the rest."""
    queries: int
    hits: int
    seconds: float


class StepResult(msgspec.Struct, tag=True, gc=False):
    """What one step produced, one row per sequence whose computed tokens reached the end of
    its known tokens: the token sampled (the most likely one for beam search, which appends
    nothing itself). `error` is set when the step failed as a whole; `errors` names sequences
    that failed alone (a token their grammar refused): their rows' tokens are not theirs to
    append. What a feature returns travels in that feature's section, None when no row used
    it: `logprobs` (SampledLogprobs), `prompt_logprobs`, `drafts` (speculative decoding),
    `tier` (disk-tier loads), `compress` (KV-Compress), `encoder` (images encoded or read
    from the encoder cache), `pooled` (pooling requests' outputs, pooling.py). `experts_read`: a mixture of
    experts' expert reads this step (each chosen expert once a layer; 0 for a dense model).
    Traces of format 1 carried these flat; trace_v1.py converts them."""
    step_id: int
    seq_ids: list[SeqId]
    token_ids: list[int]
    error: str | None = None
    errors: dict[SeqId, str] | None = None
    logprobs: SampledLogprobs | None = None
    prompt_logprobs: PromptLogprobsResult | None = None
    drafts: DraftsResult | None = None
    tier: TierResult | None = None
    compress: CompressResult | None = None
    experts_read: int = 0
    encoder: EncoderResult | None = None
    pooled: PooledResult | None = None


class AbortAll(msgspec.Struct, tag=True):
    """From the supervisor when the gateway was restarted: its clients are gone, so end every
    request (each still gets its final "abort" delta)."""
    reason: str


class DetokenizerStarted(msgspec.Struct, tag=True):
    """From a detokenizer once it listens (at start and after a restart): the scheduler answers
    with a DetokResync (to_detokenizer.py), the state of every request it holds or ended
    lately, so nothing a dead detokenizer held is lost."""


SchedulerInbox = (NewRequest | PromptPiece | Abort | StepResult | AbortAll | KvLeaseEnded
                  | KvPulled | SleepEngine | WakeEngine | UpdateWeights | ControlDone
                  | DetokenizerStarted)
