"""Weights a CPU decode step streams, on 2 MiB pages: over 4 KiB pages each page costs a TLB
miss and stops the hardware prefetcher at its end, so the same kernel reads the same bytes
faster from huge pages (bench/NOTES.md "Weights on huge pages"). move() puts tensors into one
private anonymous mapping advised MADV_HUGEPAGE before it is written, so the kernel backs it
with huge pages as it is filled (where THP is not "never"): the tiles of every quantized or
bfloat16-tiled linear (kernels/quant.py QuantWeight; back_model, before anything takes their
addresses) and each loaded LoRA adapter's A and B^T (executor/lora.py Loaded). zeros() makes
the CPU KV pool there: decode reads its blocks scattered, a few KiB each, so on 4 KiB pages
nearly every block costs a TLB miss ("The KV pool on huge pages"). PAGEWIRE_HUGE_PAGES=0
leaves all of them on ordinary pages."""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64            # each tensor's start: a cache line, as the kernels' loads expect


# move() hands the heap's freed pages back to the OS after every this many bytes copied, so
# the tiles are not held twice: an 8B model's 6 GiB of tiles peaked at 13.9 GiB moving
# (glibc keeps freed tensors' memory in its heap, past its mmap threshold's reach).
TRIM_EVERY = 256 << 20


def release_freed_memory() -> None:
    """Hand memory freed to glibc's heap (loading's dequantized and packed buffers) back to
    the OS: resident memory is then what is held (~0.4 GiB less after loading the default
    model)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class Trimmer:
    """release_freed_memory() after every TRIM_EVERY bytes a loop reports done."""

    def __init__(self):
        self.pending = 0

    def after(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= TRIM_EVERY:
            release_freed_memory()
            self.pending = 0


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and \
        os.environ.get("PAGEWIRE_HUGE_PAGES", "1") not in ("0", "false", "no")


def _tiled(model: torch.nn.Module) -> list:
    """Every QuantWeight of the model's linears (kernels/linear.py Linear.quantized), once."""
    seen = {id(w): w for m in model.modules() if (w := getattr(m, "quantized", None)) is not None}
    return list(seen.values())


# id(mapping) -> the [start, end) addresses of each live mapping _arena made (on_huge_pages)
_LIVE: dict[int, tuple[int, int]] = {}


def _arena(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous mapping of at least nbytes from a 2 MiB boundary, advised huge, and a
    uint8 tensor over that aligned part (the mapping must outlive it)."""
    # Private: a shared anonymous mapping is shmem, which THP leaves alone by default.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    _LIVE[id(mapping)] = (whole.data_ptr(), whole.data_ptr() + len(mapping))
    weakref.finalize(mapping, _LIVE.pop, id(mapping), None)
    return mapping, whole[skip:skip + nbytes]


def on_huge_pages(t: torch.Tensor) -> bool:
    """t lies in a live mapping of this module's (place, move, zeros)."""
    address = t.data_ptr()
    return any(start <= address < end for start, end in _LIVE.values())


def place(sizes: list[int]) -> list[torch.Tensor] | None:
    """Unwritten uint8 tensors of these byte sizes in one mapping on huge pages, each from a
    cache line, for a reader to fill: the tile cache is read so (tile_cache.load), the tiles
    written once where they stay, rather than read into ordinary pages and copied (move).
    None when turned off or smaller than a huge page. The tensors keep the mapping alive."""
    aligned = [_aligned(n) for n in sizes]
    if not _enabled() or sum(aligned) < HUGE_PAGE:
        return None
    _, arena = _arena(sum(aligned))
    out, offset = [], 0
    for nbytes, size in zip(sizes, aligned):
        out.append(arena[offset:offset + nbytes])
        offset += size
    return out


def move(tensors: list[torch.Tensor]) -> mmap.mmap | None:
    """Move the CPU tensors into one mapping on huge pages, each from a cache line, values
    unchanged (`set_`: every holder of a tensor reads the new place; views taken before keep
    the old storage). Returns the mapping, which the caller keeps as long as the tensors
    live; None when turned off, or when they fill less than one huge page (the page would
    be mostly empty memory: a tiny model's, a small adapter's). Each tensor once in the list."""
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("huge_pages.move: contiguous tensors only")
    sizes = [_aligned(t.nbytes) for t in tensors]
    if not _enabled() or sum(sizes) < HUGE_PAGE:
        return None
    mapping, arena = _arena(sum(sizes))
    offset, trim = 0, Trimmer()
    for t, size in zip(tensors, sizes):
        view = arena[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        t.set_(view)             # the old storage is freed here, if nothing else holds it
        offset += size
        trim.after(size)
    return mapping


def zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """`count` zeroed tensors of `shape` in one mapping on huge pages, each from a cache line;
    None when turned off or smaller than a huge page. The tensors keep the mapping alive
    (their storage holds it). Nothing is written: a fresh anonymous mapping reads as zeros,
    and the kernel backs (and zeroes) each 2 MiB page at its first write, one fault per page
    (~0.1 ms; a 4 KiB page's faults, ~500 times as many, made a 64-token cache write 200x
    slower), so a pool's memory grows as it fills, not at start-up (zeroing 10 GiB held a
    start 13 s)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    size = _aligned(nbytes)
    if not _enabled() or count * size < HUGE_PAGE:
        return None
    _, arena = _arena(count * size)
    return [arena[i * size:i * size + nbytes].view(dtype).view(shape) for i in range(count)]


def back_model(model: torch.nn.Module, keep: list) -> int:
    """Move the model's tiles onto huge pages (their values unchanged; each QuantWeight's
    table rewritten to the new addresses); returns the bytes moved. The mapping goes into
    `keep`, which must live as long as the model (the backend that prepared it keeps it)."""
    weights = _tiled(model)
    # once each: a joined weight (fused q|k|v) shares its parts' segment tensors
    tiles = list({id(s.tiles): s.tiles for w in weights for s in w.segments}.values())
    placed = [t for t in tiles if on_huge_pages(t)]      # read there from the tile cache
    mapping = move([t for t in tiles if not on_huge_pages(t)])
    if mapping is not None:
        for w in weights:
            w.refresh_table()
        keep.append(mapping)
    elif not placed:
        return 0
    nbytes = sum(t.nbytes for t in (tiles if mapping is not None else placed))
    log.info("weights: %d MiB of tiles on 2 MiB pages", nbytes >> 20)
    return nbytes
