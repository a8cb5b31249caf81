"""The executor's sampling of a step (ModelRunner.execute, runner.py): the sequences that
sample, each with one row of logits per position it samples (its last token's, and each
draft's when it verifies drafts), turned into one SamplingBatch (sampler.py: parameters, the
min_tokens bans, histories for logits processors, grammar bitmasks from grammar_matchers.py),
sampled by the backend, and the drafts verified; the tokens and logprobs go into the step's
StepResult.

Only rank 0 holds grammar matchers (`matchers` is None on the others): rank 0's tokens are
every rank's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from pagewire.wire.ids import SeqId
from pagewire.wire.sampling_params import LogprobsChunk
from pagewire.wire.to_scheduler import DraftsResult, SampledLogprobs, StepResult

from .backend import Backend
from .draft_proposers import accepted
from .grammar_matchers import Matchers
from .parallel import TensorParallel
from .sampler import DraftedSpan, LogprobRequest, SamplingBatch
from .seq_table import SeqState


class Drawn(NamedTuple):
    """A step's draw: token ids [S] and the logprobs asked for, still on the device, and
    (where the device is not host memory) a copy of the ids on its way to the host
    (Backend.copy_back)."""
    tokens: torch.Tensor
    wanted: LogprobRequest
    logprobs: torch.Tensor | None
    copy: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def ready(self) -> bool:
        """Whether the ids can be read without waiting for the device."""
        return self.copy is None or self.copy[1].query()

    def host_tokens(self) -> list[int]:
        if self.copy is None:
            return self.tokens.tolist()
        self.copy[1].synchronize()
        return self.copy[0].tolist()


class StepSampler:
    def __init__(self, backend: Backend, tp: TensorParallel, matchers: Matchers | None,
                 eos_ids: list[int]):
        self.backend, self.tp, self.matchers, self.eos_ids = backend, tp, matchers, eos_ids

    def sample(self, logits: torch.Tensor, sample_seqs: list[tuple[SeqId, SeqState]], masks,
               result: StepResult) -> list[list[int]]:
        """Sample every row (a speculative sequence has one per position: its last token's
        and each draft's), fill the result's tokens and logprobs; returns each sequence's
        tokens: one, or the drafts verified and the first token that differed."""
        return self.read(self.draw(logits, sample_seqs, masks), sample_seqs, result)

    def draw(self, logits: torch.Tensor, sample_seqs: list[tuple[SeqId, SeqState]],
             masks) -> Drawn:
        """The device's part: the rows' tokens (and logprobs) as tensors, nothing read back."""
        batch = self._batch(sample_seqs, masks)
        wanted = LogprobRequest.of(batch.params)
        logprobs = wanted.log_softmax(logits, self.backend.upload)   # before sampling edits them
        # Every rank samples (they keep the tokens for the next step); rank 0's choice is
        # everyone's, so a rank never runs ahead on a token rank 0 did not pick.
        spans, r = [], 0
        for _, seq in sample_seqs:               # model drafts of random requests
            if seq.draft_probs:
                spans.append(DraftedSpan(r, list(seq.verifying), torch.stack(seq.draft_probs)))
            r += 1 + len(seq.verifying)
        tokens = self.tp.broadcast(self.backend.sample(logits, batch, spans))
        return Drawn(tokens, wanted, logprobs, self.backend.copy_back(tokens))

    def read(self, drawn: Drawn, sample_seqs: list[tuple[SeqId, SeqState]],
             result: StepResult) -> list[list[int]]:
        """The host's part: the tokens read back, drafts judged, the result filled."""
        tokens, wanted, logprobs = drawn.tokens, drawn.wanted, drawn.logprobs
        flat, first, produced, extra, r = drawn.host_tokens(), [], [], {}, 0
        for sid, seq in sample_seqs:
            k = len(seq.verifying)
            first.append(r)
            out = flat[r:r + accepted(seq.verifying, flat[r:r + k]) + 1]
            produced.append(out)
            if len(out) > 1:
                extra[sid] = out[1:]
            r += k + 1
        result.token_ids = [out[0] for out in produced]
        chunks = {}
        if logprobs is not None:      # row r + i holds the logprobs of a sequence's i-th token
            lps, ids, tops = wanted.gather(logprobs, tokens)
            result.logprobs = SampledLogprobs([lps[r] for r in first], [ids[r] for r in first],
                                              [tops[r] for r in first])
            chunks = {sid: LogprobsChunk(out[1:], lps[r + 1:r + len(out)],
                                         ids[r + 1:r + len(out)], tops[r + 1:r + len(out)])
                      for (sid, _), r, out in zip(sample_seqs, first, produced) if len(out) > 1}
        if extra:                     # num_drafts joins in ModelRunner.execute()
            result.drafts = DraftsResult(extra, chunks, {})
        return produced

    def grammar_masks(self, sample_seqs: list[tuple[SeqId, SeqState]]):
        """(rows of the constrained sequences, a future of their bitmasks), or None."""
        rows, matchers, r = [], [], 0          # a drafting sequence has several rows
        for _, seq in sample_seqs:
            if seq.matcher is not None:
                at = self.matchers.at_positions(seq.matcher, seq.verifying)
                rows.extend(range(r, r + len(at)))
                matchers.extend(at)
            r += 1 + len(seq.verifying)
        if not rows:
            return None
        return rows, self.matchers.fill_async(matchers)

    def _batch(self, sample_seqs: list[tuple[SeqId, SeqState]],
                        masks=None) -> SamplingBatch:
        params, index, banned = [], [], []
        for _, seq in sample_seqs:
            s = seq.sampling
            for n_out in range(seq.num_output_tokens, seq.num_output_tokens + 1 +
                               len(seq.verifying)):    # one row per position (drafts)
                params.append(s)
                index.append(n_out)
                banned.append((([] if s.ignore_eos else self.eos_ids) + s.stop_token_ids)
                              if n_out < s.min_tokens else [])
        histories = None             # a draft's row sees the drafts before it as history
        if any(p.has_logits_processors for p in params):
            histories = [(seq.token_ids + seq.verifying[:i], seq.num_prompt_tokens)
                         for _, seq in sample_seqs for i in range(1 + len(seq.verifying))]
        batch = SamplingBatch(params, index, banned, histories)
        if masks is not None:
            batch.grammar_rows, batch.grammar_masks = masks[0], masks[1].result()
        return batch
