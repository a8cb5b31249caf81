"""Reading trace format 1: its StepResult carried every feature's result flat (logprobs,
top_ids, top_logprobs, prompt_logprobs, extra_token_ids, extra_logprobs, num_drafts,
kv_loaded, head_lens); format 2 carries them in sections (to_scheduler.py). A format-1
scheduler frame is decoded with a frozen copy of the old struct and rebuilt sectioned, so a
recording made before still replays. Every other message is the same in both formats.
"""
from __future__ import annotations

import msgspec

from .ids import SeqId
from .kv_transfer import KvLeaseEnded, KvPulled
from .sampling_params import LogprobsChunk
from .to_scheduler import (AbortAll, Abort, CompressResult, DraftsResult, NewRequest,
                           PromptLogprobsResult, PromptPiece, SampledLogprobs, StepResult,
                           TierResult)


class _StepResultV1(msgspec.Struct, tag="StepResult", gc=False):
    """StepResult as format 1 wrote it (frozen: never edit, old recordings depend on it)."""
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
    extra_logprobs: dict[SeqId, LogprobsChunk] | None = None
    num_drafts: dict[SeqId, int] | None = None
    kv_loaded: dict[SeqId, int] | None = None
    head_lens: dict[SeqId, list[int]] | None = None


_SchedulerInboxV1 = (NewRequest | PromptPiece | Abort | _StepResultV1 | AbortAll | KvLeaseEnded
                     | KvPulled)
_scheduler_decoder_v1 = msgspec.msgpack.Decoder(_SchedulerInboxV1)


def sectioned(old: _StepResultV1) -> StepResult:
    """The format-2 StepResult the format-1 one stands for. A section is present exactly when
    the executor of format 2 would have sent it: the old fields were None when unused."""
    drafts = None
    if (old.extra_token_ids, old.extra_logprobs, old.num_drafts) != (None, None, None):
        drafts = DraftsResult(old.extra_token_ids or {}, old.extra_logprobs or {},
                              old.num_drafts or {})
    return StepResult(
        old.step_id, old.seq_ids, old.token_ids, old.error, old.errors,
        logprobs=(SampledLogprobs(old.logprobs, old.top_ids, old.top_logprobs)
                  if old.logprobs is not None else None),
        prompt_logprobs=(PromptLogprobsResult(old.prompt_logprobs)
                         if old.prompt_logprobs is not None else None),
        drafts=drafts,
        tier=TierResult(old.kv_loaded) if old.kv_loaded is not None else None,
        compress=CompressResult(old.head_lens) if old.head_lens is not None else None)


def decode_scheduler_frame(frame: bytes) -> msgspec.Struct:
    """A format-1 frame sent to the scheduler, as the format-2 message."""
    msg = _scheduler_decoder_v1.decode(frame)
    return sectioned(msg) if isinstance(msg, _StepResultV1) else msg
