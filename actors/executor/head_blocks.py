"""KV-Compress on the executor: each sequence's head rows inside the blocks the scheduler gave
it, the step's per-layer view of them, and the compression after a step.

A block of the scheduler's is H = layers x KV heads sub-blocks of the pool (block b: sub-blocks
b H .. b H + H - 1, kernels/kv_compress.py), and any of a sequence's sub-blocks may serve any of
its rows. Both sides count the same way: a sequence whose rows hold lens[i] tokens needs
ceil(sum_i ceil(lens[i] / bs) / H) blocks (`blocks_for`). After a compression the rows are
packed into the sequence's first that-many blocks and the rest are dropped from its table, as
the scheduler frees them when the result tells it the rows' lengths.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from pagewire.kernels.kv_compress import HeadBatch, Observed, choose_kept

from ..scheduler.head_tables import blocks_for
from .kv_blocks import allocate_kv_cache


class HeadBlocks:
    """One sequence's head rows. Invariant: every sub-block of `blocks` is in exactly one row's
    table (its first counts[i] entries) or in `free`; free is ordered last-block-first, so
    pop() takes the earliest, and packing after a compression moves little."""

    def __init__(self, rows: int, block_size: int):
        self.rows, self.bs = rows, block_size
        self.lens = np.zeros(rows, dtype=np.int64)       # tokens each row holds
        self.counts = np.zeros(rows, dtype=np.int64)     # sub-blocks in each row's table
        self.table = np.zeros((rows, 8), dtype=np.int64)
        self.blocks: list[int] = []
        self.free: list[int] = []

    def sync(self, block_ids: list[int]) -> None:
        """Take the blocks the scheduler appended to the sequence's table."""
        new = block_ids[len(self.blocks):]
        self.blocks += new
        subs = [b * self.rows + j for b in new for j in range(self.rows)]
        self.free = subs[::-1] + self.free

    def reserve(self, n: int) -> np.ndarray:
        """Room for n more tokens in every row; returns their slots [rows, n] (token j of row i
        at slots[i, j]) and counts them held."""
        need = -(-(self.lens + n) // self.bs)
        width = int(need.max())
        if width > self.table.shape[1]:
            grown = np.zeros((self.rows, max(width, 2 * self.table.shape[1])), dtype=np.int64)
            grown[:, :self.table.shape[1]] = self.table
            self.table = grown
        for i in np.nonzero(need > self.counts)[0]:
            for c in range(self.counts[i], need[i]):
                self.table[i, c] = self.free.pop()
        self.counts = np.maximum(self.counts, need)
        pos = self.lens[:, None] + np.arange(n)                                  # [rows, n]
        subs = np.take_along_axis(self.table, pos // self.bs, axis=1)
        self.lens += n
        return subs * self.bs + pos % self.bs

    def slots_of(self, i: int, index: np.ndarray) -> np.ndarray:
        return self.table[i, index // self.bs] * self.bs + index % self.bs

    def pack(self, kept: list[np.ndarray], pool: torch.Tensor) -> int:
        """Keep only `kept` (per row, ascending indices) in each row, moved to its front, then
        the rows' sub-blocks into the first blocks_for(lens) blocks. Returns that count; the
        sequence's table is cut to it."""
        src, dst = [], []
        for i, index in enumerate(kept):
            src.append(self.slots_of(i, index))
            dst.append(self.slots_of(i, np.arange(len(index))))
        _move(pool, np.concatenate(src), np.concatenate(dst), 1)
        self.lens = np.array([len(index) for index in kept], dtype=np.int64)
        counts = -(-self.lens // self.bs)
        for i in range(self.rows):
            self.free += self.table[i, counts[i]:self.counts[i]].tolist()
        self.counts = counts
        keep = blocks_for(self.lens, self.bs)
        self._pack_blocks(keep, pool)
        return keep

    def _pack_blocks(self, keep: int, pool: torch.Tensor) -> None:
        """Move the sub-blocks held in blocks past the first `keep` into free ones before it."""
        first = {b for b in self.blocks[:keep]}
        inside = [s for s in self.free if s // self.rows in first]
        moves = []
        for i in range(self.rows):
            for c in range(self.counts[i]):
                if int(self.table[i, c]) // self.rows not in first:
                    fresh = inside.pop()
                    moves.append((int(self.table[i, c]), fresh))
                    self.table[i, c] = fresh
        if moves:
            src, dst = zip(*moves)
            _move(pool, np.array(src), np.array(dst), self.bs)
        order = {b: k for k, b in enumerate(self.blocks[:keep])}
        self.free = sorted(inside, key=lambda s: (order[s // self.rows], s), reverse=True)
        self.blocks = self.blocks[:keep]


def _move(pool: torch.Tensor, src: np.ndarray, dst: np.ndarray, width: int) -> None:
    """Copy pool entries (slots: width 1; sub-blocks: width bs) src -> dst, keys and values;
    every source is read before any destination is written."""
    if len(src) == 0:
        return
    flat = pool.view(torch.uint8)                  # (no float8 indexing)
    flat = flat.view(2, -1, width, flat.shape[-1])
    flat[:, torch.from_numpy(dst)] = flat[:, torch.from_numpy(src)]


class Compressor:
    """The runner's KV-Compress part: the step's HeadBatch, and the compressions after it."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, rate: float,
                 window: int):
        self.layers, self.hkv, self.bs = num_layers, num_kv_heads, block_size
        self.rows = num_layers * num_kv_heads
        self.rate, self.window = rate, window

    @classmethod
    def of(cls, config, model) -> "Compressor":
        return cls(model.cfg.num_layers, model.num_kv_heads, config.cache.block_size,
                   config.cache.kv_compress_rate, config.cache.kv_compress_window)

    def allocate(self, num_blocks: int, width: int, dtype: torch.dtype,
                 device: torch.device | None) -> torch.Tensor:
        """The zeroed pool [2, num_blocks H, bs, 1, width] (kv_blocks.allocate_kv_cache: why
        zeroed, and on huge pages in host memory: device None)."""
        return allocate_kv_cache(1, num_blocks * self.rows, self.bs, 1, width, dtype, device)[0]

    def layout(self, order) -> HeadBatch:
        """The step's rows for `order` (runner._layout's sequences, decodes first): reserves
        each sequence's slots for its scheduled tokens."""
        L, hkv = self.layers, self.hkv
        slots, decodes, prefills, observed, start = [], [], [], [], 0
        for _, seq in order:
            heads = seq.heads
            if heads is None:
                heads = seq.heads = HeadBlocks(self.rows, self.bs)
            heads.sync(seq.block_ids)
            n = seq.num_scheduled
            s = heads.reserve(n)                                          # [H, n]
            slots.append(s.reshape(L, hkv, n).transpose(0, 2, 1).reshape(L, n * hkv))
            width = int(heads.counts.max())
            if seq.runs_as_decode:
                decodes.append(heads)
            else:
                prefills.append(torch.from_numpy(heads.table[:, :width].reshape(L, hkv, width)))
            if seq.compress:
                observed.append(Observed(start, n, torch.from_numpy(heads.table[:, :width].copy()),
                                         torch.from_numpy(heads.lens.copy())))
            start += n
        tables, lens = _decode_rows(decodes, L, hkv)
        return HeadBatch(torch.from_numpy(np.concatenate(slots, axis=1)), tables, lens,
                         prefills, observed)

    def compress(self, order, batch: HeadBatch, pool: torch.Tensor) -> dict:
        """After the step: each compressing sequence keeps its most attended tokens; returns
        {seq id: its rows' lengths} (the scheduler frees what the sequence no longer holds)."""
        observed = iter(batch.observed)
        out = {}
        for sid, seq in order:
            if not seq.compress:
                continue
            obs = next(observed)
            rate = seq.sampling.kv_compress_rate or self.rate
            total = seq.num_computed + seq.num_scheduled
            keep = math.ceil(round(rate * total, 6))
            lens = obs.lens.view(self.layers, self.hkv)
            kept = []
            for layer in range(self.layers):
                kept += [k.numpy() for k in choose_kept(obs.scores[layer].cpu(), lens[layer],
                                                        keep, self.window)]
            del seq.block_ids[seq.heads.pack(kept, pool):]
            out[sid] = seq.heads.lens.tolist()
        return out


def _decode_rows(decodes: list[HeadBlocks], layers: int, hkv: int):
    """The decode sequences' rows, layer by layer: tables [L, B Hkv, W] (padded with
    sub-block 0) and lengths [L, B Hkv]; (None, None) for none."""
    if not decodes:
        return None, None
    width = max(int(h.counts.max()) for h in decodes)
    tables = np.zeros((layers, len(decodes) * hkv, width), dtype=np.int64)
    lens = np.empty((layers, len(decodes) * hkv), dtype=np.int64)
    for j, heads in enumerate(decodes):
        w = int(heads.counts.max())
        tables[:, j * hkv:(j + 1) * hkv, :w] = heads.table[:, :w].reshape(layers, hkv, w)
        lens[:, j * hkv:(j + 1) * hkv] = heads.lens.reshape(layers, hkv)
    return torch.from_numpy(tables), torch.from_numpy(lens)
