"""KV cache events: what the scheduler publishes about its prefix cache, in vLLM's layout, so a
consumer written for vLLM (a cache-aware router, an indexer) decodes them unchanged.

A batch is one step's events, msgpack-encoded as msgspec `array_like` structs, each event a
tagged array (its class name first):

    KVEventBatch = [ts, [event, ...], data_parallel_rank]   (rank: None, one engine)
    BlockStored  = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id, medium, lora_name]
    BlockRemoved = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

It goes out on a ZeroMQ PUB socket as three frames [topic, sequence number (8 bytes, big
endian, from 0), payload]; a ROUTER socket answers a start sequence number (8 bytes) with the
buffered batches from it on, each [seq, payload], then [-1 (8 bytes, signed), b""]
(kv_event_publisher.py). This is vLLM's array layout (kv_events.py before its map encoding):
every vLLM-compatible consumer reads it, and msgspec decoders of older, shorter structs ignore
the trailing fields.

Block hashes are pagewire's prefix-cache hashes (scheduler/kv_manager.py: SHA-256 chains over
the KV dtype, cache salt, adapter, token ids and image digests) as vLLM publishes its own: the
hash's last 8 bytes as an unsigned big-endian integer (external_hash). Imports no torch.
"""
from __future__ import annotations

import msgspec

MEDIUM_DEVICE = "GPU"          # the engine's KV pool, under vLLM's name for it (any device)
END_SEQ = (-1).to_bytes(8, "big", signed=True)      # the replay's end marker


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks newly findable in the prefix cache: consecutive blocks of one sequence, each the
    child of the one before it, the first the child of parent_block_hash (None: a chain's
    first block). token_ids: len(block_hashes) * block_size tokens."""
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer findable (evicted for reuse)."""
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block is gone (the scheduler started, or restarted, with an empty pool)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """A prefix-cache hash as the events carry it: its low 64 bits (vLLM's int block hashes)."""
    return int.from_bytes(block_hash[-8:], "big")


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
