"""The disk KV tier's files: where they live, what a file holds, and the scan at start.

One file per full block and executor rank, named by the block's chained hash (kv_manager.py:
the hash already covers the tokens, their prefix, the cache salt, the LoRA adapter and the KV
dtype). Everything else that changes a block's bytes names the directory: the weights (and a
draft model's), the dtype, quantization, block size and the rank's share of the heads. So a
file is only ever found by an engine that would have computed the same bytes.

A file is a 64-byte header (magic, hash, payload length, CRC-32 of the payload) and the
payload: the block's K/V rows of every layer, as the executor's caches hold them. Files are
written to a temporary name and renamed, so a reader sees a whole file or none; a file whose
header or length is wrong (torn by a crash, or not ours) is removed by the scan, one whose
payload fails its CRC by the executor that reads it. Imports no torch (the scheduler scans).
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib

import msgspec

MAGIC = b"PWKV\x00\x00\x00\x01"
HEADER = struct.Struct("<8s32sQI12x")        # magic, block hash, payload length, crc32
SUFFIX = ".kv"
LAYOUT_VERSION = 1                           # bump when the payload's layout changes


def layout_key(config, rank: int) -> str:
    """Everything besides a block's hash that decides its bytes on this rank, as a name: the
    disk tier's directory, and what two engines compare before a KV transfer."""
    info, draft = config.model.model_info, config.model.draft_model_info
    what = {"layout": LAYOUT_VERSION, "weights": info.digest,
            "draft": draft.digest if draft is not None else None, "dtype": config.model.dtype,
            "kv": config.cache.kv_cache_dtype, "quantization": config.model.quantization,
            "activations": config.device.quantized_activations,
            "block_size": config.cache.block_size}
    name = hashlib.sha256(msgspec.json.encode(what)).hexdigest()[:16]
    return f"{name}-tp{rank}of{config.parallel.tensor_parallel_size}"


def tier_directory(config, rank: int) -> str:
    """The directory of one rank's files under --kv-offload-dir."""
    return os.path.join(config.cache.kv_offload_dir, layout_key(config, rank))


def present(config) -> list[bytes] | None:
    """What the scheduler's tier index starts from: the hashes rank 0 holds (another rank
    missing one fails that load, which then computes), or None without a tier."""
    return scan(tier_directory(config, 0)) if config.cache.kv_offload_dir else None


def file_path(directory: str, block_hash: bytes) -> str:
    return os.path.join(directory, block_hash.hex() + SUFFIX)


def header(block_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """The 64 bytes that precede `payload` in its file."""
    return HEADER.pack(MAGIC, block_hash, len(payload), zlib.crc32(payload))


def unpack(block_hash: bytes, data: bytes | bytearray) -> memoryview | None:
    """The payload of a file's bytes, or None if they are not a whole, intact file of
    `block_hash`."""
    if len(data) < HEADER.size:
        return None
    magic, stored_hash, length, crc = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size:]
    if magic != MAGIC or stored_hash != block_hash or length != len(payload) \
            or zlib.crc32(payload) != crc:
        return None
    return payload


def _whole(path: str, name: str) -> bytes | None:
    """The hash a file holds if its name, header and size agree (the payload's CRC is checked
    when it is read), else None."""
    try:
        block_hash = bytes.fromhex(name[:-len(SUFFIX)])
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except (ValueError, OSError):
        return None
    if len(block_hash) != 32 or len(head) != HEADER.size:
        return None
    magic, stored_hash, length, _ = HEADER.unpack(head)
    ok = magic == MAGIC and stored_hash == block_hash and size == HEADER.size + length
    return block_hash if ok else None


def scan(directory: str) -> list[bytes]:
    """The hashes of the whole files in `directory`, least recently used first (by mtime: a
    load touches its file). Removes leftovers of interrupted writes and files not ours."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.is_file(follow_symlinks=False):
            continue
        block_hash = _whole(entry.path, entry.name) if entry.name.endswith(SUFFIX) else None
        if block_hash is None:
            remove(entry.path)
        else:
            found.append((entry.stat().st_mtime_ns, block_hash))
    return [h for _, h in sorted(found)]


def remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
