"""Sequence ids: which request, and which of its sequences, as a typed pair (never a string
grammar parsed back).

A request (NewRequest.req_id, chosen by the gateway or the offline LLM) runs as one or more
sequences. Every component names a sequence by a SeqId:
- index j >= 0: output sequence j (0 for a request with one output); the detokenizer, the
  gateway and the offline LLM only ever see these;
- PROMPT (-1): the prompt of a request that forks into its n / best_of sequences once
  computed (the scheduler and executor only);
- beam(req, k): beam hypothesis k of a beam search (the scheduler and executor only).
"""
from __future__ import annotations

import msgspec

PROMPT = -1


class SeqId(msgspec.Struct, array_like=True, frozen=True, gc=False, order=True):
    req: str           # the request's id
    index: int = 0     # see the module docstring

    def __str__(self) -> str:
        """For logs and tests: "r" (a request's only output), "r#1", "r#prompt", "r#beam3"."""
        if self.index >= 0:
            return self.req if self.index == 0 else f"{self.req}#{self.index}"
        return f"{self.req}#prompt" if self.index == PROMPT else f"{self.req}#beam{-2 - self.index}"


def output_ids(req_id: str, count: int) -> list[SeqId]:
    """A request's output sequences, as the scheduler, detokenizer and gateway all name them."""
    return [SeqId(req_id, j) for j in range(count)]


def beam(req_id: str, k: int) -> SeqId:
    """Beam hypothesis k of a request (k counts every hypothesis the search ever forked)."""
    return SeqId(req_id, -2 - k)
