"""Decode rows laid out for attention: block tables and context lengths, a batch of one decode
row a sequence at given positions (the runner's speculative rows, a model's draft passes), and
a batch moved to the model's device."""
from __future__ import annotations

import numpy as np
import torch

from pagewire.kernels.attention import AttentionBatch, PrefillSpan
from pagewire.kernels.cascade import shared_prefix

from .seq_table import SeqState


def decode_tables(decodes: list[tuple[SeqState, int]], block_size: int,
                  cascade: tuple[int, int] | None = None) -> dict:
    """Block tables and context lengths of decode rows: (sequence, context length) each; with
    `cascade` thresholds (rows, tokens), the blocks they all begin with when worth attending
    once (kernels/cascade.py)."""
    if not decodes:
        return {"decode_block_tables": None, "decode_context_lens": None}
    context = [c for _, c in decodes]
    width = -(-max(context) // block_size)
    pad = [0] * width           # rows padded in lists, then one conversion (not one per row)
    tables = np.array([blocks + pad[:width - len(blocks)]
                       for blocks in (seq.block_ids[:width] for seq, _ in decodes)],
                      dtype=np.int64)
    context = np.array(context, dtype=np.int64)
    return {"decode_block_tables": torch.from_numpy(tables),
            "decode_context_lens": torch.from_numpy(context),
            "cascade": shared_prefix(tables, context, block_size, *cascade) if cascade else None}


def decode_batch(seqs: list[SeqState], positions: list[int], block_size: int) -> AttentionBatch:
    """One decode row a sequence, at the given positions (their slots already granted)."""
    slots = [seq.block_ids[p // block_size] * block_size + p % block_size
             for seq, p in zip(seqs, positions)]
    return AttentionBatch(slot_mapping=torch.tensor(slots), num_decode_tokens=len(seqs),
                          prefills=[], **decode_tables(list(zip(seqs, [p + 1 for p in positions])),
                                                       block_size))


def batch_to(batch: AttentionBatch, dev: torch.device, staged=None) -> AttentionBatch:
    """The batch's tensors on `dev`; the batch itself where they are there already (the
    runner lays batches out in host memory). The copies do not block: a blocking one would
    wait for every step queued on the device (overlapped steps, step_overlap.py); `staged`
    (Backend.staged) puts a host tensor where such a copy reads it."""
    if batch.slot_mapping.device == dev:
        return batch

    def to(t):
        if t is None:
            return None
        return (t if staged is None else staged(t)).to(dev, non_blocking=True)
    return AttentionBatch(
        to(batch.slot_mapping), batch.num_decode_tokens,
        to(batch.decode_block_tables), to(batch.decode_context_lens),
        [PrefillSpan(p.start, p.num_tokens, p.context_len, to(p.block_table), p.key_ends)
         for p in batch.prefills],
        None if batch.cascade is None else batch.cascade.to(dev),
        None if batch.heads is None else batch.heads.to(dev))
