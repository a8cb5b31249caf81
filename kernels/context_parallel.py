"""Context parallelism's attention half (vLLM's decode context parallel): each of `size` ranks
holds every `size`-th token of every sequence's KV — position p on rank p % size, at local
position p // size — so a context `size` times longer than one rank's KV fits. A query
attends its rank's tokens with the backend's own decode kernel (which returns the
log-sum-exp), and the ranks' partial outputs merge by log-sum-exp into the attention over
the whole context.

Built here: the token layout (which rank holds a token, where; how many tokens of a context
a rank holds) and the merge; tested against one rank attending everything
(tests/kernels/test_context_parallel.py). Not built yet: the engine's side (ranks that
replicate the weights or share a KV head under tensor parallelism, the all-gather of the
partial outputs, the scheduler's blocks of block_size x size tokens) — see issue #22.
"""
from __future__ import annotations

import torch


def local_lengths(context_lens: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """[B] tokens of each context that `rank` holds: positions p < ctx with p % size == rank."""
    return (context_lens - rank + size - 1).div(size, rounding_mode="floor").clamp_(min=0)


def local_positions(positions: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Where `rank` keeps each position (its local position), or -1 where another rank
    holds it: the slots a rank writes this step's keys and values to."""
    return torch.where(positions % size == rank, positions.div(size, rounding_mode="floor"),
                       torch.full_like(positions, -1))


def merge_ranks(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [S, B, H, D], lses [S, B, H]: each of S ranks' attention over its own tokens ->
    attention over all of them [B, H, D], float32. A rank that holds none of a row's tokens
    (lse -inf, or the native kernels' large negative; its output may be NaN) weighs nothing."""
    top = lses.amax(0)                                                    # [B, H]
    weights = torch.exp(lses - top)                                       # [S, B, H]
    weights = weights / weights.sum(0)
    return (torch.nan_to_num(outs.float()) * weights[..., None]).sum(0)
