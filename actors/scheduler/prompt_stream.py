"""Streaming input, the scheduler's side: a request whose prompt arrives in pieces
(NewRequest.prompt_open, then PromptPieces in order, the last one closing it).

While the prompt is open its last known token is held back (Sequence.target_len): the step
that computes it samples, so it waits for more prompt or for the close. Pieces that arrive
after the sequence's state went to the executor travel in the next RunSeq (new_prompt_ids).
The tokenizer refuses a streamed prompt with several outputs, so the request has one
sequence while its prompt is open.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:         # request.py makes a StreamState for a request opened streaming
    from .request import Sequence


@dataclass(slots=True)
class StreamState:
    """A streamed request's prompt: whether more comes, and the pieces its executor lacks."""
    open: bool = True
    not_sent: list[int] = field(default_factory=list)   # arrived, not yet sent


def extend_prompt(seq: Sequence, tokens: list[int], last: bool, max_model_len: int) -> None:
    """A piece of seq's open prompt arrived."""
    req = seq.request
    seq.token_ids += tokens
    req.num_prompt_tokens += len(tokens)
    if seq.on_executor:
        req.stream.not_sent += tokens
    req.max_tokens = req.room_to_generate(max_model_len)
    req.stream.open = not last
