"""Converted weights cached on disk, so a restart reads them instead of converting again:
a GGUF file's tensors dequantized to the dtype (kind "gguf": only where a dense copy is
held), the blocks --quantization rounds a float checkpoint's linears to (kinds "int8",
"int4": load_quantization.py), and a GGUF model's packed tiles (kind "tiles":
tile_cache.py).

One safetensors file per (model digest, dtype, kind, converter version) under
$PAGEWIRE_CACHE_DIR/weights (default ~/.cache/pagewire/weights), written once, atomically
(a temporary file renamed into place), and read on the next start. The converter
version is a hash of the modules that convert (gguf_weights.py, load_quantization.py, ...),
so a change in how weights are converted never reads a stale file.

The directory is pruned as each file is written: files of another converter version (never
read again) go, then the least recently used until the whole is within
$PAGEWIRE_WEIGHT_CACHE_GIB (default 32), the file just written kept. PAGEWIRE_WEIGHT_CACHE=0
turns the cache off.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import torch

from pagewire.hf_tokenizer import cache_dir

log = logging.getLogger(__name__)

DEFAULT_LIMIT_GIB = 32


def _enabled() -> bool:
    return os.environ.get("PAGEWIRE_WEIGHT_CACHE", "1") not in ("0", "false", "no")


_HERE = os.path.dirname(__file__)
_KERNELS = os.path.join(_HERE, "..", "..", "kernels")
# kind -> the sources that convert (their hash versions the cache files)
_CONVERTERS = {
    "gguf": ("gguf_weights.py", "gguf_names.py"),
    "int8": ("load_quantization.py",),
    "int4": ("load_quantization.py",),
    "tiles": ("gguf_weights.py", "gguf_names.py", "parallel.py", "tile_cache.py",
              os.path.join(_KERNELS, "quant.py"), os.path.join(_KERNELS, "gguf_blocks.py"),
              os.path.join(_KERNELS, "csrc", "quant_tiles.h")),
}


def _converter_version(kind: str) -> str:
    digest = hashlib.sha256()
    for name in _CONVERTERS[kind.split("-")[0]]:
        path = name if os.path.isabs(name) else os.path.join(_HERE, name)
        if not os.path.isfile(path):         # an installed package without kernels' sources
            path = os.path.join(os.path.dirname(torch.__file__), "version.py")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:8]


def cache_path(digest: str, dtype: torch.dtype, kind: str = "gguf") -> str:
    tag = "" if kind == "gguf" else f"-{kind}"
    name = (f"{digest}-{str(dtype).removeprefix('torch.')}{tag}-{_converter_version(kind)}"
            ".safetensors")
    return os.path.join(cache_dir("weights"), name)


def load(digest: str, dtype: torch.dtype, kind: str = "gguf") -> dict[str, torch.Tensor] | None:
    """The cached tensors (read into memory), or None when there is no usable cache file."""
    found = load_with_metadata(digest, dtype, kind)
    return None if found is None else found[0]


def load_with_metadata(digest: str, dtype: torch.dtype, kind: str = "gguf", place=None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """load()'s tensors and the metadata store() wrote beside them; `place(sizes)`, when
    given, says where they are read: uint8 tensors of those byte sizes, or None (memory of
    their own)."""
    if not _enabled():
        return None
    path = cache_path(digest, dtype, kind)
    if not os.path.isfile(path):
        return None
    try:
        found = _read(path, place)
        os.utime(path)                     # recently used: pruned last
        return found
    except (OSError, ValueError, KeyError) as e:   # damaged: convert again, rewrite it
        log.warning("ignoring the weight cache %s: %s", path, e)
        return None


_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
           "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
           "F32": torch.float32}


def _read(path: str, place=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata, read into memory of this process rather
    than mapped: a mapping's pages count in the resident set beside the copies the loader
    makes of them (huge_pages.move), so a mapped 6 GB file held an 8B model's warm start at
    twice its tiles."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        metadata = header.pop("__metadata__", None) or {}
        tensors, base = {}, 8 + size
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        sizes = [entry["data_offsets"][1] - entry["data_offsets"][0] for _, entry in entries]
        places = place(sizes) if place is not None else None
        for i, (name, entry) in enumerate(entries):
            begin, end = entry["data_offsets"]
            out = places[i] if places else torch.empty(end - begin, dtype=torch.uint8)
            f.seek(base + begin)
            if f.readinto(memoryview(out.numpy())) != end - begin:
                raise ValueError(f"{name}: the file ends early")
            tensors[name] = out.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors, metadata


def store(digest: str, dtype: torch.dtype, weights: dict[str, torch.Tensor],
          kind: str = "gguf", metadata: dict[str, str] | None = None) -> None:
    """Write the converted tensors for the next start, then prune the directory; a failure
    (disk full, read-only cache) is logged and costs nothing else."""
    if not _enabled():
        return
    from safetensors.torch import save_file
    path = cache_path(digest, dtype, kind)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in weights.items()}, tmp, metadata)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        prune(keep=path)
    except OSError as e:
        log.warning("could not cache converted weights at %s: %s", path, e)


def prune(keep: str, limit: int | None = None) -> list[str]:
    """Remove cache files of stale converter versions, then the least recently used until
    the directory holds at most `limit` bytes (default $PAGEWIRE_WEIGHT_CACHE_GIB); never
    `keep`. Returns the removed files' names."""
    if limit is None:
        limit = int(float(os.environ.get("PAGEWIRE_WEIGHT_CACHE_GIB", DEFAULT_LIMIT_GIB)) * 2**30)
    directory = os.path.dirname(keep)
    current = {_converter_version(kind) for kind in _CONVERTERS}
    files = []
    for entry in os.scandir(directory):
        if entry.is_file() and entry.name.endswith(".safetensors"):
            stat = entry.stat()
            files.append((stat.st_mtime, stat.st_size, entry.path))
    removed, total = [], sum(size for _, size, _ in files)
    stale = [f for f in files if os.path.basename(f[2]).rsplit("-", 1)[-1].split(".")[0]
             not in current]
    for mtime, size, path in stale + sorted(set(files) - set(stale)):
        if path == keep or (total <= limit and (mtime, size, path) not in stale):
            continue
        os.unlink(path)
        removed.append(os.path.basename(path))
        total -= size
    if removed:
        log.info("weight cache: removed %s", ", ".join(removed))
    return removed
