"""`pagewire router --policy kv-aware`: what the router knows of each replica's prefix cache,
from the replica's KV events (wire/kv_events.py), and the match of a request against it.

The router names a block by a key of its own: the hash of (its parent's key, its token ids),
chained from a fixed root, over the request's token ids cut in the replica's block size. A
replica's BlockStored gives, for each block, the replica's hash, its parent's hash and its
tokens: the router computes that block's key from the parent's key and the tokens and keeps
replica hash -> key. So the router never reproduces the engine's hash function (pagewire's
SHA-256 chain over its KV dtype, salts and adapters, or vLLM's): what it matches is the
engine's own chain, translated link by link. Blocks the replica hashes with a salt or an
adapter have keys equal to unsalted ones of the same tokens: such a block can look cached to
a request that cannot use it (a wasted preference, never a wrong answer).

Besides the blocks the events confirm, a replica is credited for a short while (`pending_ttl`)
with the blocks of the requests just sent to it: the events of a prompt come only once it
is computed, and the requests right behind it that share its prefix should follow it there.
"""
from __future__ import annotations

import time
from typing import Callable

from pagewire.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

ROOT = 0


def block_keys(token_ids: list[int], block_size: int) -> list[int]:
    """The router's keys of every full block of token_ids."""
    keys, parent = [], ROOT
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[i:i + block_size])))
        keys.append(parent)
    return keys


class ReplicaCache:
    """One replica's prefix cache as its events tell it."""

    def __init__(self, pending_ttl: float = 30.0, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic):
        self.key_of: dict[int, int] = {}        # the replica's block hash -> the router's key
        self.held: dict[int, int] = {}          # key -> how many of the replica's hashes have it
        self.pending: dict[int, float] = {}     # key -> until when it counts (sent, unconfirmed)
        self.block_size = block_size            # the replica's: its events say
        self.pending_ttl, self.clock = pending_ttl, clock
        self.unlinked = 0                        # stored blocks whose parent was unknown
        self.purge_at = clock() + pending_ttl

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if type(event) is BlockStored:
                self._stored(event)
            elif type(event) is BlockRemoved:
                for h in event.block_hashes:
                    self._removed(h)
            elif type(event) is AllBlocksCleared:
                self.clear()

    def clear(self) -> None:
        self.key_of.clear()
        self.held.clear()
        self.pending.clear()

    def _stored(self, event: BlockStored) -> None:
        self.block_size = size = event.block_size
        parent = ROOT if event.parent_block_hash is None else \
            self.key_of.get(event.parent_block_hash)
        if parent is None:           # its parent's event was missed: the chain cannot be linked
            self.unlinked += len(event.block_hashes)
            return
        for i, h in enumerate(event.block_hashes):
            parent = hash((parent, tuple(event.token_ids[i * size:(i + 1) * size])))
            if h not in self.key_of:
                self.key_of[h] = parent
                self.held[parent] = self.held.get(parent, 0) + 1
            self.pending.pop(parent, None)

    def _removed(self, h: int) -> None:
        key = self.key_of.pop(h, None)
        if key is None:
            return
        self.pending.pop(key, None)
        if self.held[key] == 1:
            del self.held[key]
        else:
            self.held[key] -= 1

    def __len__(self) -> int:
        return len(self.key_of)

    def match(self, keys: list[int]) -> int:
        """How many leading blocks of `keys` the replica holds (or was just sent)."""
        now, n = self.clock(), 0
        for key in keys:
            if key not in self.held and self.pending.get(key, 0.0) <= now:
                break
            n += 1
        return n

    def sent(self, keys: list[int]) -> None:
        """A request with these blocks was just placed here."""
        now = self.clock()
        until = now + self.pending_ttl
        for key in keys:
            if key not in self.held:
                self.pending[key] = until
        if now >= self.purge_at:                # forget the expired, once a ttl
            self.pending = {k: t for k, t in self.pending.items() if t > now}
            self.purge_at = now + self.pending_ttl
