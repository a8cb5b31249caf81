"""Token sampling for a batch of rows with per-row parameters.

Random rows draw by inverting the cumulative distribution: one uniform u in (0, 1] per row, the
first token whose cumulative probability reaches u times the row's total. That needs one random
number per row instead of one per vocabulary entry (the exponential race, argmax p / E, cost
70 ms a step at batch 64 here; this costs 2). A seeded row's uniform comes from a generator
seeded by (seed, output index), so the same seed gives the same tokens whatever else shares
the batch, and a request resumed after preemption draws exactly what it would have drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewire.kernels.native import Library
from pagewire.wire.sampling import SamplingParams

from .logits_processors import apply_logits_processors

_MIX = 0x9E3779B97F4A7C15


@dataclass
class SamplingBatch:
    """Per-row parameters for one step; rows follow the logits' rows."""
    params: list[SamplingParams]
    output_index: list[int]             # how many tokens each row has generated before this one
    banned: list[list[int]]             # token ids masked per row (EOS before min_tokens)
    histories: list[tuple[list[int], int]] | None = None   # (tokens, prompt length) per row

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


def sample(logits: torch.Tensor, batch: SamplingBatch, lib: Library | None = None) -> torch.Tensor:
    """logits: [S, V] float32 (modified in place) -> token ids [S] int64. `lib`: the
    backend's native library, whose draw runs where it serves."""
    if batch.histories is not None:
        apply_logits_processors(logits, batch.params, batch.histories)
    _apply_bans(logits, batch.banned)
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    is_greedy = [p.greedy for p in batch.params]
    greedy = logits.argmax(dim=-1) if any(is_greedy) else None
    dev = logits.device
    temps = [p.temperature if not p.greedy else 1.0 for p in batch.params]
    if any(t != 1.0 for t in temps):
        logits.div_(torch.tensor(temps, device=dev).unsqueeze(1))
    _apply_top_k_top_p(logits, batch.params)
    _apply_min_p(logits, batch.params)
    sampled = draw(logits, _uniforms(batch, dev), lib)
    if greedy is None:
        return sampled
    return torch.where(torch.tensor(is_greedy, device=dev), greedy, sampled)


def draw(logits: torch.Tensor, uniforms: torch.Tensor, lib: Library | None = None) -> torch.Tensor:
    """Per row of logits [S, V], the first token whose cumulative softmax probability reaches
    uniforms [S, 1] (in (0, 1]) of the total: the native kernel on the CPU (one fused pass per
    row, no [S, V] temporaries), else softmax, cumsum and a search."""
    if lib is not None and lib.sample_serves(logits):
        return lib.sample_rows(logits, uniforms)
    return draw_by_search(logits, uniforms)


def draw_by_search(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """draw on any device: the reference for the native kernel."""
    cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)                # [S, V]
    target = uniforms.mul(cdf[:, -1:])                                 # [S, 1] in (0, total]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _apply_bans(logits: torch.Tensor, banned: list[list[int]]) -> None:
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    if rows:
        cols = [t for ids in banned for t in ids]
        logits[rows, cols] = float("-inf")


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Mask tokens outside each row's top-k and top-p nucleus (the most likely token always
    survives)."""
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params]
    top_p = [p.top_p if not p.greedy else 1.0 for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= torch.tensor(top_k, device=dev).unsqueeze(1)     # [S, V] in sorted order
    sorted_logits.masked_fill_(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= torch.tensor(top_p, device=dev).unsqueeze(1)
    drop[:, 0] = False
    logits.scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    min_p = [p.min_p if not p.greedy else 0.0 for p in params]
    if not any(min_p):
        return
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * \
        torch.tensor(min_p, device=logits.device).unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def _uniforms(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """[S, 1] uniforms in (0, 1]: never 0, so a token of zero probability is never drawn."""
    u = 1.0 - torch.rand((len(batch.params), 1), device=device)
    for row, (p, index) in enumerate(zip(batch.params, batch.output_index)):
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=device).manual_seed(
                (p.seed ^ ((index + 1) * _MIX)) & (2**63 - 1))
            u[row] = 1.0 - torch.rand(1, generator=gen, device=device)
    return u


@dataclass
class LogprobRequest:
    """Which rows want log-probabilities: the sampled token's (`rows`), and the top k
    (`top_k`, per row; beam search asks for 2 * width candidates). Log-probabilities are the
    model's own (log-softmax of the raw logits, before temperature and filtering)."""
    rows: list[int]
    top_k: list[int]
    num_rows: int

    @classmethod
    def of(cls, params: list[SamplingParams]) -> "LogprobRequest":
        rows, top_k = [], []
        for i, p in enumerate(params):
            k = 2 * p.num_sequences if p.use_beam_search else (p.logprobs or 0)
            if p.logprobs is not None or p.use_beam_search:
                rows.append(i)
                top_k.append(k)
        return cls(rows, top_k, len(params))

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[S, V] -> [len(rows), V], or None when no row asked."""
        return torch.log_softmax(logits[self.rows], dim=-1) if self.rows else None

    def gather(self, logprobs: torch.Tensor, tokens: torch.Tensor):
        """Per row of the batch: the sampled token's logprob, the top-k ids and logprobs
        (0.0, [], [] for rows that did not ask)."""
        sampled = [0.0] * self.num_rows
        top_ids = [[] for _ in range(self.num_rows)]
        top_lps = [[] for _ in range(self.num_rows)]
        picked = logprobs.gather(1, tokens[self.rows].unsqueeze(1)).squeeze(1).tolist()
        k_max = max(self.top_k)
        values, indices = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
        for j, (row, k) in enumerate(zip(self.rows, self.top_k)):
            sampled[row] = picked[j]
            if k:
                top_ids[row] = indices[j, :k].tolist()
                top_lps[row] = values[j, :k].tolist()
        return sampled, top_ids, top_lps
