"""Speculative decoding, the executor's side: draft tokens proposed after each step, and a
step's speculative rows verified.

Proposers look tokens up, they run no model (InStepDraft below does, for methods self and
draft_model): `ngram` finds the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) earlier in its own tokens and proposes
what followed; `suffix` also searches the outputs of sequences that finished recently here.
The scheduler learns how many drafts a sequence holds from the step's result and grants up
to that many in the next plan (scheduler/speculation.py).

Verification is exact for any proposal that is a single token per position (a one-hot
draft): every position of the row is sampled as a plain decode would sample it (same
processing, same seeded uniform for the same output index), and the draft is accepted while
each sampled token equals it. A position's token then follows the target's distribution
whatever was proposed, so greedy and seeded outputs are the tokens decoding without drafts
gives; the first sampled token that differs from its draft is kept, the rest dropped.

A model drafts a greedy request's tokens as its argmax (one-hot, as above). For a random
request it draws each draft from its own distribution q after the request's temperature,
top-k, top-p and min-p, keeps q, and the step judges those drafts by rejection sampling
against the target's distribution p (executor/sampler.py, kernels/token_sampling.py): draft x kept
with probability min(1, p(x) / q(x)), else a token from max(p - q, 0). Outputs follow the
target's distribution exactly and a seed reproduces them, but a seeded request's tokens are
not those of decoding without drafts (other uniforms decide them); it accepts 1 - TV(p, q)
of its drafts where one-hot ones accept p(argmax q).
"""
from __future__ import annotations

import numpy as np
import torch

from pagewire.kernels import token_sampling

from .decode_layout import batch_to, decode_batch
from .mrope import rope_positions
from .sampler import sampling_tensors, uniforms

_RECENT_OUTPUTS = 64          # finished sequences whose tokens `suffix` also searches


class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) of a token list was last followed by a token:
    n-gram -> that token's index. Extended as tokens are appended (max_n entries a token), so
    a lookup costs the same at any length. A sequence's own index never holds its current
    suffix (nothing follows it yet), so a match is always an earlier occurrence."""

    def __init__(self, min_n: int, max_n: int):
        self.lengths = range(max_n, min_n - 1, -1)       # longest first
        self.after: dict[tuple[int, ...], int] = {}
        self.size = 0

    def extend(self, tokens: list[int]) -> None:
        """Index tokens[self.size:] (tokens only ever grow)."""
        for t in range(max(self.size, 1), len(tokens)):
            for n in self.lengths:
                if t >= n:
                    self.after[tuple(tokens[t - n:t])] = t
        self.size = len(tokens)

    def follow(self, suffix_of: list[int], corpus: list[int], limit: int) -> list[int]:
        """What followed, in `corpus` (the indexed list), the latest occurrence of the longest
        indexed suffix of `suffix_of`, at most `limit` tokens."""
        for n in self.lengths:
            if len(suffix_of) >= n:
                t = self.after.get(tuple(suffix_of[-n:]))
                if t is not None:
                    return corpus[t:t + limit]
        return []


class Proposer:
    def __init__(self, config):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        # self, draft_model: drafted by a model in the verifying step (InStepDraft)
        self.model_drafting = config.method in ("self", "draft_model")
        # suffix: the last _RECENT_OUTPUTS finished sequences' (index, tokens); ngram: None
        self.recent: list[tuple[NgramIndex, list[int]]] | None = \
            [] if config.method == "suffix" else None

    def index(self) -> NgramIndex:
        """A fresh index for a sequence's own tokens."""
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, tokens: list[int], own: NgramIndex) -> list[int]:
        """Up to k tokens likely to follow `tokens` ([] when nothing matches); `own` is the
        sequence's index, brought up to date here."""
        own.extend(tokens)
        drafts = own.follow(tokens, tokens, self.k)
        for index, corpus in reversed(self.recent or []):
            if drafts:
                break
            drafts = index.follow(tokens, corpus, self.k)
        return drafts

    def remember(self, tokens: list[int]) -> None:
        """A sequence ended: `suffix` keeps its tokens (and their index) to draft from."""
        if self.recent is None:
            return
        corpus = tokens[-4096:]
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(corpus)
        self.recent = self.recent[-(_RECENT_OUTPUTS - 1):] + [(index, corpus)]


class InStepDraft:
    """Drafts proposed in the step that verifies them: greedy, one pass a draft, every drafting
    sequence a decode row, writing K/V at the sequence's own slots (the scheduler granted them).

    - method self: the target's first `layers` layers, final norm and LM head over those
      layers' caches. The verification that follows writes the same positions in every layer,
      so nothing a draft wrote outlives the step.
    - method draft_model: a second model over caches of its own, indexed by the same block ids.
      It also runs every token the target runs (its draft passes, and mirror() for the
      rest), so its K/V at a block holds what the target's holds there: prefix-cache hits,
      copy-on-write and swaps carry over."""

    def __init__(self, model, caches: list, block_size: int, vocab_size: int, mirrors: bool,
                 host_caches: list | None = None, tp=None):
        self.model, self.caches, self.block_size = model, caches, block_size
        self.vocab_size, self.mirrors = vocab_size, mirrors     # the target's vocabulary
        self.host_caches = host_caches or []
        self.tp = tp              # drafts are rank 0's: every rank's forward takes the same

    def own_caches(self) -> tuple[list, list]:
        """(device, host) caches that are this drafter's alone (a draft model's; method self
        drafts over the target's own)."""
        return (self.caches, self.host_caches) if self.mirrors else ([], [])

    @classmethod
    def of_target(cls, model, kv_caches: list, layers: int | None, block_size: int, tp=None):
        return cls(model, kv_caches[:layers or max(1, len(kv_caches) // 4)], block_size,
                   model.cfg.vocab_size, mirrors=False, tp=tp)

    def fill(self, seqs: list) -> None:
        """Append to each SeqState's `verifying` until it holds num_draft_slots drafts. A
        mirroring draft model runs one pass more, over the last draft, so its K/V holds every
        position the target's step writes for these sequences."""
        for i in range(max(s.num_draft_slots for s in seqs) + self.mirrors):
            rows = [s for s in seqs if i < s.num_draft_slots + self.mirrors]
            positions = [s.num_computed + i for s in rows]
            ids = [s.token_ids[p] if p < len(s.token_ids) else s.verifying[p - len(s.token_ids)]
                   for s, p in zip(rows, positions)]
            rope = [int(rope_positions(s.images, np.array([p]))[0])   # M-RoPE's shift
                    for s, p in zip(rows, positions)]                  # (mrope.py); slots: p
            hidden = self._forward(torch.tensor(ids), torch.tensor(rope),
                                   decode_batch(rows, positions, self.block_size))
            drafting = [r for r, s in enumerate(rows) if len(s.verifying) < s.num_draft_slots]
            if drafting:
                logits = self.model.compute_logits(hidden[drafting])[:, :self.vocab_size]
                self._pick(logits.float(), [rows[r] for r in drafting])

    def _pick(self, logits: torch.Tensor, seqs: list) -> None:
        """Each sequence's next draft from its logits [A, V']: the argmax for a greedy request;
        for a random one a draw from its distribution q, kept in draft_probs ([V], zero past
        the draft's vocabulary)."""
        tokens = logits.argmax(dim=-1)                                            # [A]
        rand = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        if rand:
            params = [seqs[i].sampling for i in rand]
            q = token_sampling.probabilities(logits[rand], sampling_tensors(params))   # [R, V']
            index = [seqs[i].num_output_tokens + len(seqs[i].verifying) for i in rand]
            u = uniforms(params, index, q.device, salt=3)
            tokens[rand] = token_sampling.draw_by_search(q.log(), u).to(tokens.device)
            q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[1]))
            for i, row in zip(rand, q):
                seqs[i].draft_probs.append(row)
        if self.tp is not None:
            tokens = self.tp.broadcast(tokens)
        for seq, token in zip(seqs, tokens.tolist()):
            seq.verifying.append(token)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> None:
        """Run tokens of the step that fill() did not (prefills, plain decodes, drafts a
        grammar forced), to keep this model's K/V in step with the target's."""
        self._forward(input_ids, positions, batch)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        dev = self.caches[0].device
        ids = ids.clamp(max=self.model.cfg.vocab_size - 1)    # a token it lacks: a poor draft
        return self.model(ids.to(dev), positions.to(dev), self.caches, batch_to(batch, dev))


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the sampled tokens confirm: sampled[i] is the token at the position
    drafts[i] was proposed for."""
    j = 0
    while j < len(drafts) and sampled[j] == drafts[j]:
        j += 1
    return j
