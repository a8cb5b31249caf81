"""Decode steps replayed from CUDA graphs.

A decode-only step of B sequences runs at the smallest captured size >= B: its inputs are
copied into static buffers (the graph reads only those), the rows past B are padded to attend a
scratch block and write their garbage K/V there, and the first B rows of the static output are
the result. Capture happens once per size at start-up, after a warm-up run at that size.

Where CUDA graphs are unavailable (CPU, or --enforce-eager) the same padding and buffer reuse
run eagerly if asked for (`capture=False`): that is how the CPU test suite exercises this code.
"""
from __future__ import annotations

import torch

from pagewire.kernels.attention import AttentionBatch


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Static buffers (and, on CUDA, graphs) for decode steps of up to max_batch sequences
    whose block tables are at most max_width wide. `scratch_block` must be a cache block the
    scheduler never hands out."""

    def __init__(self, model, kv_caches: list[torch.Tensor], max_batch: int, max_width: int,
                 block_size: int, scratch_block: int, capture: bool):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_batch)
        self.max_width, self.block_size, self.scratch_block = max_width, block_size, scratch_block
        device = kv_caches[0].device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.tables = torch.full((max_batch, max_width), scratch_block, dtype=torch.int64,
                                 device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture and device.type == "cuda":
            self._capture_all()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.sizes[-1] and width <= self.max_width

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of B = len(input_ids) sequences -> hidden states [B, H]."""
        batch, width = len(input_ids), tables.shape[1]
        size = self.size_for(batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slots[:batch].copy_(slots, non_blocking=True)
        self.tables[:batch, :width].copy_(tables, non_blocking=True)
        self.context_lens[:batch].copy_(context_lens, non_blocking=True)
        # Padding rows: token 0 at position 0, written to and read from the scratch block only.
        self.input_ids[batch:size] = 0
        self.positions[batch:size] = 0
        self.slots[batch:size] = self.scratch_block * self.block_size
        self.tables[batch:size, 0] = self.scratch_block
        self.context_lens[batch:size] = 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:batch]
        return self._forward(size)[:batch]

    def _forward(self, size: int) -> torch.Tensor:
        batch = AttentionBatch(slot_mapping=self.slots[:size], num_decode_tokens=size,
                               decode_block_tables=self.tables[:size],
                               decode_context_lens=self.context_lens[:size], prefills=[])
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, batch)

    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):          # largest first: smaller ones reuse its pool
            self.slots[:size] = self.scratch_block * self.block_size
            self.tables[:size] = self.scratch_block
            self.context_lens[:size] = 1
            self._forward(size)                     # warm-up: kernels compiled, allocations made
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
