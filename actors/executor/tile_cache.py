"""A GGUF model's packed tiles on disk (weight_cache.py kind "tiles"), so a restart reads
them instead of reading, converting and packing its blocks again: packing runs on one core
at ~0.15 GB/s of tiles (an 8B Q4_K_M's 6 GB: ~45 s), reading at the disk's or page cache's
rate.

One file per (model digest, native tier, roundings, rank of ranks): the tiles are the tier
library's layout for the roundings asked, this rank's share. Its metadata holds, per Linear,
its columns and each segment's kind and rows: enough to rebuild the QuantWeight over the
tiles read. A model whose blocks come from --quantization or a Hugging Face checkpoint is
not cached here (load_quantization.py caches the rounded blocks themselves).
"""
from __future__ import annotations

import json

import torch

from pagewire.kernels import quant

from . import huge_pages, weight_cache

_DTYPE = torch.uint8           # weight_cache's file names carry a dtype: the tiles' own


def kind(lib, roundings: dict[int, str], tp) -> str:
    """The weight_cache kind naming what the tiles were packed for."""
    rounded = "_".join(f"{t}{r}" for t, r in sorted(roundings.items())) or "exact"
    return f"tiles-{lib.tier}-{rounded}-{tp.rank}of{tp.size}"


def load(digest: str, cache_kind: str, lib) -> dict[str, quant.QuantWeight] | None:
    """{Linear name: its QuantWeight over the tiles read}, or None without a cache file."""
    # read straight onto huge pages (where back_model would move them): written once
    found = weight_cache.load_with_metadata(digest, _DTYPE, cache_kind, huge_pages.place)
    if found is None:
        return None
    tensors, metadata = {name: _unviewed(t) for name, t in found[0].items()}, found[1]
    try:
        layout = json.loads(metadata["layout"])
        return {name: quant.QuantWeight(
            [quant.Segment(k, tensors[f"{name}.{i}"], rows)
             for i, (k, rows) in enumerate(entry["segments"])], entry["cols"], lib,
            tensors.get(f"{name}.order")) for name, entry in layout.items()}
    except (KeyError, ValueError, TypeError):   # not this module's layout: pack again
        return None


def _unviewed(t: torch.Tensor) -> torch.Tensor:
    """t over the same storage, without the `_base` a view keeps: a view's base would hold
    the storage read after huge_pages.move gave the tiles new storage (2.4 GiB of a 3B
    model's tiles resident twice)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                               t.stride())


def store(digest: str, cache_kind: str, weights: dict[str, quant.QuantWeight]) -> None:
    """Write the packed weights for the next start (weight_cache.store: atomic, pruned)."""
    tensors, layout = {}, {}
    for name, weight in weights.items():
        for i, segment in enumerate(weight.segments):
            tensors[f"{name}.{i}"] = segment.tiles
        if weight.order is not None:
            tensors[f"{name}.order"] = weight.order
        layout[name] = {"cols": weight.cols,
                        "segments": [(s.kind, s.rows) for s in weight.segments]}
    weight_cache.store(digest, _DTYPE, tensors, cache_kind, {"layout": json.dumps(layout)})
