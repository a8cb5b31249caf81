"""Cascade attention: decode rows that all start with the same cached blocks (a long system
prompt under many requests) attend those blocks once for all of them, then each its own
suffix, and the two halves merge by log-sum-exp (FlashInfer's cascade, vLLM's
`use_cascade_attention`).

Without it every decode row reads the shared prefix's keys and values itself: B rows under a
P-token prefix read B x P rows of the cache each layer. With it the prefix is read once by the
backend's own decode kernel, every row's queries of a KV head taken as one query group; each
row then reads only its suffix. Every backend's decode kernel returns the log-sum-exp the
merge needs, so the cascade is written once, here, for all of them.

The step's batch carries a SharedPrefix when every decode row's block table begins with the
same blocks, enough rows and tokens of them for the backend (the thresholds below), found
once a step by shared_prefix(). Sliding-window
layers do not use it (a window need not see the whole prefix); soft-capping and quantized
caches do.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

# (decode rows that must share the prefix, tokens it must hold) before a cascade pays, by
# backend (each backend's `cascade_thresholds`). CPU: measured on an AVX2 machine, where the
# decode kernel is as bound by its arithmetic as by its reads, so reading the prefix once
# only pays for large batches under long prefixes (bench/NOTES.md "Cascade attention");
# CUDA: vLLM's thresholds, not measured here.
CPU_THRESHOLDS = (32, 2048)
CUDA_THRESHOLDS = (8, 256)


@dataclass(frozen=True)
class SharedPrefix:
    """The whole blocks every decode row of a step starts with, and what is left per row."""
    blocks: torch.Tensor          # [nb] int64: the shared blocks, in order
    num_tokens: int               # nb * block_size
    suffix_tables: torch.Tensor   # [B, W - nb] int64: each row's table after them
    suffix_lens: torch.Tensor     # [B] int64: each row's context after them (>= 1)

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """[1] int64: the prefix as one decode row's context (made once a step)."""
        return torch.tensor([self.num_tokens], device=self.blocks.device)

    def to(self, dev: torch.device) -> "SharedPrefix":
        return SharedPrefix(self.blocks.to(dev), self.num_tokens, self.suffix_tables.to(dev),
                            self.suffix_lens.to(dev))


def shared_prefix(tables: np.ndarray, context: np.ndarray, block_size: int,
                  min_rows: int, min_tokens: int) -> SharedPrefix | None:
    """The blocks all rows of `tables` [B, W] begin with, when at least `min_rows` rows share
    at least `min_tokens` tokens of them (a backend's cascade_thresholds). Only blocks
    before each row's last token count: a row's own token is written this step, so its block
    is never shared as a prefix (and every suffix keeps at least that token)."""
    rows = tables.shape[0]
    if rows < min_rows:
        return None
    limit = int((context.min() - 1) // block_size)
    same = (tables[:, :limit] == tables[0, :limit]).all(axis=0)
    nb = int(same.argmin()) if not same.all() else limit
    if nb == 0 or nb * block_size < min_tokens:
        return None
    return SharedPrefix(torch.from_numpy(tables[0, :nb].copy()), nb * block_size,
                        torch.from_numpy(np.ascontiguousarray(tables[:, nb:])),
                        torch.from_numpy(context - nb * block_size))


def merge_attention(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Attention over S disjoint sets of keys -> attention over their union: each part's
    normalized output (outs [S, N, H, D]) weighted by its share of the softmax mass (lses
    [S, N, H]), float32. A part that saw none of a row's keys (lse -inf, or the native
    kernels' large negative; its output may be NaN) weighs nothing. The cascade merges its
    two halves with it, context parallelism its ranks."""
    weights = torch.exp(lses - lses.amax(0))                              # [S, N, H]
    weights = weights / weights.sum(0)
    return (torch.nan_to_num(outs.float()) * weights[..., None]).sum(0)


def cascade_decode(q: torch.Tensor, num_kv_heads: int, prefix: SharedPrefix,
                   decode) -> torch.Tensor:
    """Decode rows q [B, Hq, D] under `prefix`, by the backend's decode kernel
    `decode(q, tables, lens)` -> (out, lse) run twice: once over the shared blocks for all
    rows at once — their queries stacked as one sequence whose query group is every row's
    heads of a KV head (B G heads), so the kernel reads each prefix row once for all of them
    — and once over each row's own suffix; the halves merged. [B, Hq, D] in q's dtype."""
    b, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    stacked = q.reshape(b, num_kv_heads, group, head_dim).transpose(0, 1) \
        .reshape(1, num_kv_heads * b * group, head_dim)                  # [1, Hkv B G, D]
    out_p, lse_p = decode(stacked, prefix.blocks[None], prefix.lengths)
    out_p = out_p.view(num_kv_heads, b, group, head_dim).transpose(0, 1) \
        .reshape(b, num_heads, head_dim)
    lse_p = lse_p.view(num_kv_heads, b, group).transpose(0, 1).reshape(b, num_heads)
    out_s, lse_s = decode(q, prefix.suffix_tables, prefix.suffix_lens)
    return merge_attention(torch.stack([out_p, out_s]), torch.stack([lse_p, lse_s])).to(q.dtype)
