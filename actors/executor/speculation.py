"""Speculative decoding, the executor's side: draft tokens proposed after each step, and a
step's speculative rows verified.

Proposers look tokens up, they run no model: `ngram` finds the sequence's last n tokens
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
"""
from __future__ import annotations

from collections import deque

_RECENT_OUTPUTS = 64          # finished sequences whose tokens `suffix` also searches


class Proposer:
    def __init__(self, config):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.recent: deque[list[int]] | None = \
            deque(maxlen=_RECENT_OUTPUTS) if config.method == "suffix" else None

    def propose(self, tokens: list[int]) -> list[int]:
        """Up to k tokens likely to follow `tokens` ([] when nothing matches)."""
        limit = self.k
        drafts = lookup(tokens, tokens, self.min_n, self.max_n, limit)
        if not drafts and self.recent:
            for corpus in reversed(self.recent):
                drafts = lookup(tokens, corpus, self.min_n, self.max_n, limit, own=False)
                if drafts:
                    break
        return drafts

    def remember(self, tokens: list[int]) -> None:
        """A sequence ended: `suffix` keeps its tokens to draft from."""
        if self.recent is not None:
            self.recent.append(tokens[-4096:])


def lookup(tokens: list[int], corpus: list[int], min_n: int, max_n: int, limit: int,
           own: bool = True) -> list[int]:
    """The tokens that followed the latest earlier occurrence in `corpus` of the longest
    suffix of `tokens` (of min_n..max_n tokens), at most `limit`. With `own`, corpus is
    tokens itself and the suffix's own position does not count."""
    for n in range(min(max_n, len(tokens) - (1 if own else 0)), min_n - 1, -1):
        suffix = tokens[-n:]
        end = len(corpus) - (1 if own else 0)
        for start in range(end - n, -1, -1):
            if corpus[start:start + n] == suffix:
                follow = corpus[start + n:start + n + limit]
                if follow:
                    return follow
    return []


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the sampled tokens confirm: sampled[i] is the token at the position
    drafts[i] was proposed for."""
    j = 0
    while j < len(drafts) and sampled[j] == drafts[j]:
        j += 1
    return j
