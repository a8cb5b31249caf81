"""Beam search bookkeeping: which candidates survive each step, and the final ranking.

A BeamGroup holds the live beams of one request (each a scheduler Sequence sharing blocks with
its siblings) and the finished hypotheses. The scheduler calls choose() once every live beam
has its candidates (the executor's top 2*width tokens): advance() extends, forks and drops
beams, and the scheduler adopts the forks and ends the dropped.
"""
from __future__ import annotations

import itertools

from pagewire.wire.ids import SeqId, beam as beam_id, output_ids
from pagewire.wire.sampling_params import SamplingParams
from pagewire.wire.to_scheduler import SampledLogprobs

from .request import Sequence


class BeamGroup:
    def __init__(self, req_id: str, sampling: SamplingParams, max_tokens: int):
        self.req_id = req_id
        self.width, self.n = sampling.num_sequences, sampling.n
        self.length_penalty = sampling.length_penalty
        self.max_tokens = max_tokens
        self.live: list[Sequence] = []
        # This step's (token ids, logprobs) of each live beam whose row came back.
        self.candidates: dict[SeqId, tuple[list[int], list[float]]] = {}
        self.done: list[tuple[float, list[int], str]] = []     # (score, output ids, reason)
        self._ids = itertools.count()

    def new_id(self) -> SeqId:
        return beam_id(self.req_id, next(self._ids))

    @property
    def output_ids(self) -> list[SeqId]:
        return output_ids(self.req_id, self.n)

    def offer(self, beam: Sequence, sampled: SampledLogprobs, row: int) -> None:
        """A beam's row came back: its best continuations (the executor's top 2*width, in
        the result's logprobs section)."""
        self.candidates[beam.seq_id] = (sampled.top_ids[row], sampled.top_logprobs[row])

    def ready(self) -> bool:
        return all(b.seq_id in self.candidates for b in self.live)

    def score(self, cum_logprob: float, length: int) -> float:
        return cum_logprob / max(1, length) ** self.length_penalty

    def choose(self, stop_ids: frozenset[int]) -> list[tuple[Sequence, int, float]]:
        """The next step's (beam, token, cumulative logprob), best first, at most `width`.
        Candidates ending in a stop token among the best `width` become finished hypotheses."""
        candidates = sorted(
            ((beam.cum_logprob + lp, i, beam, token) for i, beam in enumerate(self.live)
             for token, lp in zip(*self.candidates[beam.seq_id])),
            key=lambda c: (-c[0], c[1]))
        chosen = []
        for rank, (cum, _, beam, token) in enumerate(candidates):
            if len(chosen) == self.width:
                break
            if token in stop_ids:
                if rank < self.width:
                    outputs = beam.token_ids[beam.num_prompt_tokens:] + [token]
                    self.done.append((self.score(cum, len(outputs)), outputs, "stop"))
                continue
            chosen.append((beam, token, cum))
        return chosen

    def advance(self, stop_ids: frozenset[int]) -> tuple[list[Sequence], list[Sequence]]:
        """Keep the best `width` continuations: a beam chosen once is extended, one chosen
        more often forks (the forks extended too), one not chosen drops out. Returns (the
        forks, for the caller to adopt; the beams dropped, for it to end); `live` becomes
        the extended beams."""
        chosen = self.choose(stop_ids)
        live, forks, dropped = [], [], []
        for beam in self.live:
            picks = [(tok, cum) for b, tok, cum in chosen if b is beam]
            if not picks:
                dropped.append(beam)
                continue
            for token, cum in picks[1:]:
                child = beam.fork(self.new_id(), beam.sampling)
                forks.append(child)
                live.append(extend_beam(child, token, cum))
            live.append(extend_beam(beam, *picks[0]))
        self.live, self.candidates = live, {}
        return forks, dropped

    def retire_full_length(self) -> list[Sequence]:
        """Live beams that reached max_tokens become finished hypotheses; returns them."""
        full = [b for b in self.live if b.num_output_tokens >= self.max_tokens]
        for beam in full:
            outputs = beam.token_ids[beam.num_prompt_tokens:]
            self.done.append((self.score(beam.cum_logprob, len(outputs)), outputs, "length"))
        self.live = [b for b in self.live if b not in full]
        return full

    def is_finished(self) -> bool:
        """No live beams, or `width` hypotheses none of the live beams is likely to beat
        (judged at its current length, as Hugging Face's early_stopping=False does)."""
        if not self.live:
            return True
        if len(self.done) < self.width:
            return False
        worst_kept = sorted(s for s, _, _ in self.done)[-self.width]
        best_live = max(self.score(b.cum_logprob, b.num_output_tokens) for b in self.live)
        return best_live <= worst_kept

    def results(self) -> list[tuple[list[int], str]]:
        """The n best hypotheses, live beams counted as cut at their length."""
        pool = self.done + [(self.score(b.cum_logprob, b.num_output_tokens),
                             b.token_ids[b.num_prompt_tokens:], "length") for b in self.live]
        pool.sort(key=lambda h: -h[0])
        return [(outputs, reason) for _, outputs, reason in pool[: self.n]]


def extend_beam(beam: Sequence, token: int, cum: float) -> Sequence:
    """Append a chosen token to a beam (and to what its executor learns next step)."""
    beam.token_ids.append(token)
    beam.cum_logprob = cum
    if beam.on_executor:
        beam.new_token_ids.append(token)
    return beam
