"""Speculative decoding, the scheduler's side: how many of a sequence's drafts a step verifies,
and what verifying them did.

The executor proposes drafts after each step and says how many it holds (its StepResult's
drafts section, DraftsResult.num_drafts). A decode then runs 1 + k positions: its last token
and k drafts, k granted here under the token budget, max_tokens and the context; grow() gives
the lookahead K/V slots. The result holds the tokens verified (the first in token_ids, the
rest in the drafts section's extra_token_ids); the scheduler counts a draft's position as
computed only once it is accepted, so rejected positions never reach num_computed or the
prefix cache (their slots are written again by the next step). Speculation turns itself off
per step: above `max_batch` running sequences (a batch is no longer bound by reading the
weights, so drafts cost what they save), and per sequence while its acceptance (a moving
average) stays below `min_acceptance`, retrying every PROBE_EVERY steps; above it a sequence
verifies about k * acceptance of its drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagewire.wire.sampling_params import LogprobsChunk
from pagewire.wire.to_scheduler import DraftsResult, SampledLogprobs

from ..config_sections import MAX_BATCH
from .request import Sequence

PROBE_EVERY = 8           # a sequence below min_acceptance still drafts this often
_DECAY = 0.7              # weight of the past in a sequence's acceptance average


@dataclass(slots=True)
class DraftState:
    """A sequence's drafts (Sequence.spec), made when the executor first says it holds some."""
    num_drafts: int = 0           # draft tokens the executor holds for it
    num_slots: int = 0            # of which the plan in flight verifies
    acceptance: float = 1.0       # moving average of drafts accepted (0..1)
    skips: int = 0                # steps it did not draft (low acceptance)


class DraftPolicy:
    def __init__(self, config):
        self.config = config             # SpeculativeConfig, or None: never drafts
        k = config.num_speculative_tokens if config else 0
        # EngineConfig.resolve() sets it for the device; unresolved, a CPU's
        self.max_batch = (config.max_batch or MAX_BATCH["cpu"]) if config else 0
        self.num_drafts = 0              # steps that verified drafts (vLLM: num_drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k  # drafts accepted at position i (cumulative)

    def grant(self, seq: Sequence, budget: int, num_running: int) -> int:
        """Drafts seq verifies this step (0: a plain decode); called for a decode only. The
        caller records a grant in seq.spec.num_slots (a grant implies seq.spec)."""
        cfg, spec = self.config, seq.spec
        if cfg is None or spec is None or not spec.num_drafts or num_running > self.max_batch:
            return 0
        if spec.acceptance < cfg.min_acceptance:
            spec.skips += 1
            if spec.skips % PROBE_EVERY:
                return 0
        room = seq.max_tokens - seq.num_output_tokens - 1     # the step samples one more
        # Each draft costs a row whether or not it is accepted: verify as many as the
        # sequence's acceptance says are likely to be right (at least one).
        likely = max(1, round(cfg.num_speculative_tokens * spec.acceptance))
        return max(0, min(spec.num_drafts, budget, room, likely))

    def tokens_of(self, seq: Sequence, token: int, drafts: DraftsResult | None) -> list[int]:
        """seq's tokens in a result whose row for seq sampled `token`, with the result's
        drafts section: one, or the drafts it verified and the next; the verification is
        recorded and the executor's new draft count kept."""
        extra = drafts.extra_token_ids.get(seq.seq_id, []) if drafts is not None else []
        num_drafts = drafts.num_drafts.get(seq.seq_id, 0) if drafts is not None else 0
        if seq.spec is None and num_drafts:
            seq.spec = DraftState()
        if seq.spec is not None:
            if seq.spec.num_slots:
                self.verified(seq.spec, len(extra))
                seq.spec.num_slots = 0
            seq.spec.num_drafts = num_drafts
        return [token] + extra

    @staticmethod
    def logprobs_of(seq: Sequence, token: int, sampled: SampledLogprobs, row: int,
                    drafts: DraftsResult | None, count: int) -> LogprobsChunk:
        """The log-probabilities of seq's first `count` tokens in a result: its row's (which
        sampled `token`) in the logprobs section, then its drafts' in the drafts section."""
        chunk = LogprobsChunk([token], [sampled.logprobs[row]], [sampled.top_ids[row]],
                              [sampled.top_logprobs[row]])
        extra = drafts.extra_logprobs.get(seq.seq_id) if drafts is not None else None
        if extra is not None and count > 1:
            n = count - 1
            chunk = LogprobsChunk(chunk.token_ids + extra.token_ids[:n],
                                  chunk.logprobs + extra.logprobs[:n],
                                  chunk.top_ids + extra.top_ids[:n],
                                  chunk.top_logprobs + extra.top_logprobs[:n])
        return chunk

    def verified(self, spec: DraftState, accepted: int) -> None:
        """The step verified spec.num_slots drafts and accepted the first `accepted`."""
        k = spec.num_slots
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        spec.acceptance = _DECAY * spec.acceptance + (1 - _DECAY) * accepted / k
