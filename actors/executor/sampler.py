"""The engine's side of sampling: SamplingParams and request state turned into what the
kernels' sampler (pagewire.kernels.token_sampling) takes, and the log-probabilities rows ask for.

Before the kernels see the logits, the logits processors (penalties, logit bias, allowed ids,
bad words), the bans (EOS before min_tokens) and the grammar bitmasks of constrained rows
(executor/grammar_matchers.py) apply here. Random rows draw with one uniform
per row: a seeded row's comes from a generator seeded by (seed, output index), so the same seed
gives the same tokens whatever else shares the batch, and a request resumed after preemption
draws exactly what it would have drawn. Unseeded rows take theirs from one call on torch's
generator per step that samples a random row; replays start that generator from --seed, so the
number and order of those calls are part of a replay too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagewire.kernels import token_sampling
from pagewire.kernels.ops import TorchOps
from pagewire.wire.sampling_params import SamplingParams

from .logits_processors import apply_logits_processors

_REFERENCE = TorchOps()             # sample()'s kernels where no backend is given
_MIX = 0x9E3779B97F4A7C15
_SALT = 0xBF58476D1CE4E5B9


@dataclass
class SamplingBatch:
    """Per-row parameters for one step; rows follow the logits' rows."""
    params: list[SamplingParams]
    output_index: list[int]             # how many tokens each row has generated before this one
    banned: list[list[int]]             # token ids masked per row (EOS before min_tokens)
    histories: list[tuple[list[int], int]] | None = None   # (tokens, prompt length) per row
    grammar_rows: list[int] | None = None   # constrained rows, and their bitmasks:
    grammar_masks: np.ndarray | None = None  # [len(grammar_rows), ceil(V / 32)] int32

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


@dataclass
class DraftedSpan:
    """A sequence whose drafts a model drew from distributions q (a random request's drafts,
    executor/draft_proposers.py): its rows from `row` on are judged by rejection sampling."""
    row: int
    drafts: list[int]
    q: torch.Tensor                     # [k, V] float32


def sample(logits: torch.Tensor, batch: SamplingBatch, ops=None,
           spans: list[DraftedSpan] = (), upload=None) -> torch.Tensor:
    """logits: [S, V] float32 (overwritten) -> token ids [S] int64. `ops`: the backend's
    kernel set, whose sample() draws the rows (None: the torch reference's). A span's rows
    get its kept drafts then the token rejection sampling drew (kernels/token_sampling.py), the
    rows after that as sampled. `upload`: how the rows' parameters reach the logits' device
    without waiting (Backend.upload; None: plain copies)."""
    if batch.histories is not None:
        apply_logits_processors(logits, batch.params, batch.histories)
    _apply_bans(logits, batch.banned, upload)
    if batch.grammar_rows:
        apply_bitmasks(logits, batch.grammar_rows, batch.grammar_masks)
    if batch.all_greedy:                # no parameters to build, no uniforms drawn
        return logits.argmax(dim=-1)
    rows = [s.row + i for s in spans for i in range(len(s.drafts) + 1)]
    p = token_sampling.probabilities(
        logits[rows], sampling_tensors([batch.params[r] for r in rows])) if rows else None
    tokens = (ops or _REFERENCE).sample(logits, sampling_tensors(batch.params, upload),
                                        _uniforms(batch, logits.device))
    if rows:
        _judge(tokens, p.cpu(), spans, rows, batch)
    return tokens


def _judge(tokens: torch.Tensor, p: torch.Tensor, spans: list[DraftedSpan], rows: list[int],
           batch: SamplingBatch) -> None:
    """Overwrite each span's rows with its rejection-sampled tokens. The uniforms are drawn
    apart from the rows' sampling ones (other salts), so each test and draw is independent."""
    params = [batch.params[r] for r in rows]
    index = [batch.output_index[r] for r in rows]
    accept_u = uniforms(params, index, torch.device("cpu"), salt=1).flatten().tolist()
    draw_u = uniforms(params, index, torch.device("cpu"), salt=2).flatten().tolist()
    at = 0
    for span in spans:
        k = len(span.drafts)
        out = token_sampling.rejection_sample(p[at:at + k + 1], span.q.cpu(), span.drafts,
                                        accept_u[at:at + k], draw_u[at:at + k + 1])
        tokens[span.row:span.row + len(out)] = torch.tensor(out, device=tokens.device)
        at += k + 1


def sampling_tensors(params: list[SamplingParams],
                     upload=None) -> token_sampling.SamplingTensors:
    """The kernels' per-row parameters, on the CPU (the kernels' sampler reads them there to
    skip the stages no row uses), and how they reach the logits' device (`upload`)."""
    return token_sampling.SamplingTensors(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool), upload=upload)


def _apply_bans(logits: torch.Tensor, banned: list[list[int]], upload=None) -> None:
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    if rows:
        at = _where(torch.tensor([rows, [t for ids in banned for t in ids]]), logits, upload)
        logits[at[0], at[1]] = float("-inf")                    # at: [2, N] rows, cols


def _where(t: torch.Tensor, logits: torch.Tensor, upload) -> torch.Tensor:
    """A host tensor where the logits are: through `upload` (Backend.upload: no wait for
    the steps queued there) where given."""
    return upload(t) if upload is not None else t.to(logits.device)


def apply_bitmasks(logits: torch.Tensor, rows: list[int], masks: np.ndarray) -> None:
    """-inf where a row's bitmask bit is clear. logits [S, V]; masks [R, ceil(V / 32)] int32,
    bit t of word w for token 32 w + t (little-endian, as numpy unpacks it)."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")     # [R, >= V]
    banned = ~torch.from_numpy(bits[:, :logits.shape[1]]).view(torch.bool)     # [R, V]
    banned = banned.to(logits.device)
    if rows == list(range(logits.shape[0])):       # every row: no gather
        logits.copy_(torch.where(banned, float("-inf"), logits))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = torch.where(banned, float("-inf"), logits[index])


def _uniforms(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    return uniforms(batch.params, batch.output_index, device)


def uniforms(params: list[SamplingParams], output_index: list[int], device: torch.device,
             salt: int = 0) -> torch.Tensor:
    """[S, 1] uniforms in (0, 1]: never 0, so a token of zero probability is never drawn. A
    seeded row's comes from (seed, output index, salt): salt 0 samples, others serve
    speculative sampling (1: acceptance tests, 2: its draws, 3: the draft's draws)."""
    u = 1.0 - torch.rand((len(params), 1), device=device)
    for row, (p, index) in enumerate(zip(params, output_index)):
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=device).manual_seed(
                (p.seed ^ ((index + 1) * _MIX) ^ (salt * _SALT)) & (2**63 - 1))
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

    def log_softmax(self, logits: torch.Tensor, upload=None) -> torch.Tensor | None:
        """[S, V] -> [len(rows), V], or None when no row asked. `upload`: how the rows'
        index reaches the logits' device without waiting (Backend.upload)."""
        if not self.rows:
            return None
        return torch.log_softmax(logits[_where(torch.tensor(self.rows), logits, upload)], dim=-1)

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
