"""The KV pool's tensors, allocated; and pool blocks as bytes and back: what the disk tier
writes and a KV transfer sends. A block's bytes are its K/V rows in every cache given (each
[2, blocks, block_size, heads, width]; a draft model's after the target's), concatenated, as
the caches hold them (quantized KV's scales included)."""
from __future__ import annotations

import logging

import torch

from . import huge_pages

log = logging.getLogger(__name__)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      width: int, dtype: torch.dtype,
                      device: torch.device | None = None) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, width] tensor per layer (width: D, or D + 4
    for a quantized cache, kernels/kv_quant.py): never-written slots must read as zeros, not
    NaN garbage that a masked score times a value would spread. A CPU pool lies on huge pages
    where it fills one (huge_pages.zeros: zero as mapped, backed as it is first written, so
    its memory grows with use); elsewhere torch.zeros touches every page now (on 4 KiB pages
    a first write into an untouched page mid-step took a 64-token cache write from 0.03 ms to
    6.5 ms). device None: host memory, the pool a backend with Capabilities.host_memory runs
    on (Backend.kv_device); else that device's."""
    shape = (2, num_blocks, block_size, num_kv_heads, width)
    if device is None and (caches := huge_pages.zeros(num_layers, shape, dtype)):
        log.info("KV cache: %d MiB on 2 MiB pages", sum(c.nbytes for c in caches) >> 20)
        return caches
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class BlockBytes:
    def __init__(self, caches: list[torch.Tensor]):
        self.raw = [c.view(torch.uint8) for c in caches]     # [2, blocks, bs, heads, bytes]
        self.sizes = [r[:, 0].numel() for r in self.raw]
        self.block_bytes = sum(self.sizes)

    def read(self, block_ids: list[int]) -> list[bytearray]:
        """Each block's bytes (copied: the blocks may be rewritten after)."""
        index = torch.tensor(block_ids, device=self.raw[0].device)
        picked = [r[:, index].cpu() for r in self.raw]       # each [2, n, ...]
        out = []
        for i in range(len(block_ids)):
            payload = bytearray(self.block_bytes)
            view, offset = torch.frombuffer(payload, dtype=torch.uint8), 0
            for p, size in zip(picked, self.sizes):
                view[offset:offset + size].copy_(p[:, i].reshape(-1))
                offset += size
            out.append(payload)
        return out

    def write(self, block: int, payload: bytearray | memoryview) -> None:
        """Fill a block from bytes of read()'s layout (len(payload) == block_bytes)."""
        offset = 0
        for raw, size in zip(self.raw, self.sizes):
            piece = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset)
            raw[:, block].copy_(piece.view(raw[:, block].shape))
            offset += size
