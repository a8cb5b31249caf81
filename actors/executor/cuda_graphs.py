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
                 block_size: int, scratch_block: int, capture: bool,
                 lora: "GraphLora | None" = None, staged=None):
        """lora: static LoRA inputs, captured into every graph (steps with adapters and
        without replay the same graphs); None: steps with adapters run eagerly. `staged`:
        a step's host inputs where the buffers' copies read them without waiting for the
        steps queued (Backend.staged); None: as they are."""
        self.model, self.kv_caches, self.lora = model, kv_caches, lora
        self.staged = staged or (lambda t: t)
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
        if capture:                 # the backend asks for it only where graphs run (CUDA)
            self._capture_all()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.sizes[-1] and width <= self.max_width

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, context_lens: torch.Tensor, lora=None) -> torch.Tensor:
        """One decode step of B = len(input_ids) sequences -> hidden states [B, H]. `lora`:
        the rows' adapters (executor/lora.py LoraBatch; only with self.lora), or None."""
        batch, width = len(input_ids), tables.shape[1]
        size = self.size_for(batch)
        if self.lora is not None:
            self.lora.load(lora, batch, size)
        staged = self.staged
        self.input_ids[:batch].copy_(staged(input_ids), non_blocking=True)
        self.positions[:batch].copy_(staged(positions), non_blocking=True)
        self.slots[:batch].copy_(staged(slots), non_blocking=True)
        self.tables[:batch, :width].copy_(staged(tables), non_blocking=True)
        self.context_lens[:batch].copy_(staged(context_lens), non_blocking=True)
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
        lora = None if self.lora is None else self.lora.view(size)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, batch,
                          lora)

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


class GraphLora:
    """LoRA inputs at fixed addresses, as the Triton lora_delta op reads them (kernels/lora.py
    triton_lora_delta): each adapted linear's A [max_loras, max_rank, K], scaled B^T
    [max_loras, max_rank, N] and ranks [max_loras], and the rows' adapter indices. A step
    copies in its rows' indices; its adapters' weights only when the adapters (or their order)
    differ from the last step's, so steady decoding copies nothing but the indices. Ranks
    past an adapter's own and adapters past the step's are masked by `ranks`, not zeroed."""

    def __init__(self, linears: dict[int, tuple[int, int, int]], max_batch: int,
                 max_loras: int, device: torch.device):
        """linears: each adapted linear's slot -> (in features K, out features N, the most
        rank rows an adapter may give it)."""
        self.adapter_of_row = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.stacks = {slot: (torch.zeros(max_loras, r, k, device=device),
                              torch.zeros(max_loras, r, n, device=device),
                              torch.zeros(max_loras, dtype=torch.int32, device=device))
                       for slot, (k, n, r) in linears.items()}
        self.key: tuple[int, ...] = ()          # the adapters whose weights are in (none)

    @classmethod
    def of(cls, model, max_batch: int, max_loras: int, max_rank: int) -> "GraphLora":
        """A fused linear stacks its projections' A rows (executor/lora.py PARTS): up to
        max_rank rows for each."""
        from .lora import PARTS
        linears = {}
        for layer in model.layers:
            for name, parts in PARTS.items():
                lin = layer.get_submodule(name)
                linears[lin.lora_slot] = (lin.in_features, lin.out_features,
                                          len(parts) * max_rank)
        return cls(linears, max_batch, max_loras, model.embed.weight.device)

    def view(self, size: int) -> "_Rows":
        return _Rows(self.adapter_of_row[:size], self.stacks)

    def load(self, lora, batch: int, size: int) -> None:
        """The step's rows (the first `batch` of `size`) and adapters (a LoraBatch, or None:
        every row the base model's) into the buffers."""
        if lora is None:
            self.adapter_of_row[:size] = -1
            return
        self.adapter_of_row[:batch].copy_(lora.adapter_of_row, non_blocking=True)
        self.adapter_of_row[batch:size] = -1
        key = tuple(a.generation for a in lora.adapters)
        if key == self.key:
            return
        for slot, (a, bt, ranks) in self.stacks.items():
            ranks.zero_()
            stacked = lora.dense(slot)
            if stacked is not None:
                step_a, step_bt, step_ranks = stacked             # [L, R, K], [L, R, N], [L]
                n, r = step_a.shape[:2]
                a[:n, :r].copy_(step_a)
                bt[:n, :r].copy_(step_bt)
                ranks[:n].copy_(step_ranks)
        self.key = key


class _Rows:
    """What the captured forward's lora_delta ops read: a LoraBatch's two members."""

    def __init__(self, adapter_of_row: torch.Tensor, stacks: dict):
        self.adapter_of_row, self._stacks = adapter_of_row, stacks

    def dense(self, slot: int):
        return self._stacks.get(slot)
