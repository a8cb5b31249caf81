"""A CPU model's packed weights on 2 MiB pages: a decode step streams every tile once, and
over 4 KiB pages each page costs a TLB miss and stops the hardware prefetcher at its end, so
the same kernel reads the same bytes faster from huge pages (bench/NOTES.md "Weights on huge
pages"). The tiles of every quantized or bfloat16-tiled linear (kernels/quant.py QuantWeight)
move into one anonymous mapping advised MADV_HUGEPAGE before it is written, so the kernel
backs it with huge pages as it is filled (where THP is not "never"). Run before anything
takes the tiles' addresses (the fused decode's tables). PAGEWIRE_HUGE_PAGES=0 leaves them."""
from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64            # each tensor's start: a cache line, as the kernels' loads expect


def _enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and \
        os.environ.get("PAGEWIRE_HUGE_PAGES", "1") not in ("0", "false", "no")


def _tiled(model: torch.nn.Module) -> list:
    """Every QuantWeight of the model's linears, once."""
    seen: dict[int, object] = {}
    for module in model.modules():
        weight = getattr(module, "quantized", None)
        if weight is not None and hasattr(weight, "segments"):
            seen.setdefault(id(weight), weight)
    return list(seen.values())


def _arena(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous mapping of at least nbytes from a 2 MiB boundary, advised huge, and a
    uint8 tensor over that aligned part (the mapping must outlive it)."""
    # Private: a shared anonymous mapping is shmem, which THP leaves alone by default.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return mapping, whole[skip:skip + nbytes]


def back_model(model: torch.nn.Module) -> int:
    """Move the model's tiles onto huge pages (their values unchanged; each QuantWeight's
    table rewritten to the new addresses); returns the bytes moved."""
    weights = _tiled(model)
    tiles = [s.tiles for w in weights for s in w.segments]
    if not _enabled() or not tiles:
        return 0
    sizes = [(t.numel() + _ALIGN - 1) // _ALIGN * _ALIGN for t in tiles]
    mapping, arena = _arena(sum(sizes))
    offset = 0
    for t, size in zip(tiles, sizes):
        view = arena[offset:offset + t.numel()].view(t.shape)
        view.copy_(t)
        t.set_(view)               # every holder of the tensor now reads the arena
        offset += size
    for w in weights:
        w.refresh_table()
    model.huge_page_arena = mapping
    log.info("weights: %d MiB of tiles on 2 MiB pages", offset >> 20)
    return offset
