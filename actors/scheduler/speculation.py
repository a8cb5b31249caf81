"""Speculative decoding, the scheduler's side: how many of a sequence's drafts a step
verifies, and what verifying them did.

The executor proposes drafts after each step and says how many it holds (StepResult
.num_drafts). A decode then runs 1 + k positions: its last token and k drafts, k granted
here under the token budget, max_tokens and the context; grow() gives the lookahead K/V
slots. The result holds the tokens verified (the first in token_ids, the rest in
extra_token_ids); the scheduler counts a draft's position as computed only once it is
accepted, so rejected positions never reach num_computed or the prefix cache (their slots are
written again by the next step). Speculation turns itself off per step: above `max_batch`
running sequences (a batch is no longer bound by reading the weights, so drafts cost what
they save), and per sequence while its acceptance (a moving average) stays below
`min_acceptance`, retrying every PROBE_EVERY steps; above it a sequence verifies about
k * acceptance of its drafts.
"""
from __future__ import annotations

from pagewire.wire.sampling_params import LogprobsChunk
from pagewire.wire.to_scheduler import StepResult

from ..config_sections import MAX_BATCH
from .request import Request

PROBE_EVERY = 8           # a sequence below min_acceptance still drafts this often
_DECAY = 0.7              # weight of the past in a sequence's acceptance average


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

    def grant(self, req: Request, budget: int, num_running: int) -> int:
        """Drafts req verifies this step (0: a plain decode); called for a decode only."""
        cfg = self.config
        if cfg is None or not req.num_drafts or num_running > self.max_batch:
            return 0
        if req.draft_acceptance < cfg.min_acceptance:
            req.draft_skips += 1
            if req.draft_skips % PROBE_EVERY:
                return 0
        room = req.max_tokens - req.num_output_tokens - 1     # the step samples one more
        # Each draft costs a row whether or not it is accepted: verify as many as the
        # sequence's acceptance says are likely to be right (at least one).
        likely = max(1, round(cfg.num_speculative_tokens * req.draft_acceptance))
        return max(0, min(req.num_drafts, budget, room, likely))

    def tokens_of(self, req: Request, result: StepResult, row: int) -> list[int]:
        """req's tokens in the result (one, or the drafts it verified and the next), with the
        verification recorded and the executor's new draft count kept."""
        extra = (result.extra_token_ids or {}).get(req.seq_id, [])
        if req.num_draft_slots:
            self.verified(req, len(extra))
            req.num_draft_slots = 0
        req.num_drafts = (result.num_drafts or {}).get(req.seq_id, 0)
        return [result.token_ids[row]] + extra

    @staticmethod
    def logprobs_of(req: Request, result: StepResult, row: int, count: int) -> LogprobsChunk:
        """The log-probabilities of req's first `count` tokens in the result."""
        chunk = LogprobsChunk([result.token_ids[row]], [result.logprobs[row]],
                              [result.top_ids[row]], [result.top_logprobs[row]])
        extra = (result.extra_logprobs or {}).get(req.seq_id)
        if extra is not None and count > 1:
            n = count - 1
            chunk = LogprobsChunk(chunk.token_ids + extra.token_ids[:n],
                                  chunk.logprobs + extra.logprobs[:n],
                                  chunk.top_ids + extra.top_ids[:n],
                                  chunk.top_logprobs + extra.top_logprobs[:n])
        return chunk

    def verified(self, req: Request, accepted: int) -> None:
        """The step verified req.num_draft_slots drafts and accepted the first `accepted`."""
        k = req.num_draft_slots
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        req.draft_acceptance = _DECAY * req.draft_acceptance + (1 - _DECAY) * accepted / k
