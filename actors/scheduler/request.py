"""The scheduler's record of one request."""
from __future__ import annotations

import enum

from pagewire.wire.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Mutated only by the scheduler. `num_computed` counts tokens whose K/V are in the cache;
    tokens [num_computed, len(token_ids)) are still to run. `on_executor` says the executor
    holds this request's state (it got a NewSeq and has not been told to drop it)."""

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling", "arrival_time",
                 "max_tokens", "status", "num_computed", "num_scheduled", "block_ids",
                 "num_blocks_sent", "on_executor")

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 arrival_time: float, max_model_len: int):
        self.req_id = req_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.arrival_time = arrival_time
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_scheduled = 0
        self.block_ids: list[int] = []
        self.num_blocks_sent = 0
        self.on_executor = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens not yet computed."""
        return len(self.token_ids) - self.num_computed
