"""The scheduler's record of KV cache events (--kv-events-config), present only when they are
published: the device pool's BlockManager reports evictions to it, BlockTables reports the
blocks it commits, and the scheduler actor takes one KVEventBatch a step to publish.

Invariant: applying the events taken so far, in order, to an empty set of hashes gives
exactly the hashes the device pool's prefix cache holds (BlockManager.cached), as
external_hash()es. The first batch starts with AllBlocksCleared: a consumer that knew this
engine before a restart forgets what it held.
"""
from __future__ import annotations

import time

from pagewire.wire.kv_events import (MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved,
                                     BlockStored, KVEventBatch, external_hash)


class KvEventLog:
    def __init__(self, block_size: int, medium: str = MEDIUM_DEVICE):
        self.block_size, self.medium = block_size, medium
        self.events: list = [AllBlocksCleared()]

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int],
               lora) -> None:
        """Consecutive blocks of one sequence, the first the child of `parent`; `lora`: the
        request's LoraRef or None."""
        self.events.append(BlockStored(
            [external_hash(h) for h in hashes], None if parent is None else external_hash(parent),
            token_ids, self.block_size, None if lora is None else lora.id, self.medium,
            None if lora is None else lora.name))

    def removed(self, block_hash: bytes) -> None:
        """One block evicted; runs of evictions become one event (order is kept: a removal
        after a store of the same hash never moves before it)."""
        last = self.events[-1] if self.events else None
        if type(last) is BlockRemoved:
            last.block_hashes.append(external_hash(block_hash))
        else:
            self.events.append(BlockRemoved([external_hash(block_hash)], self.medium))

    def cleared(self) -> None:
        """Every cached block forgotten at once (sleep mode, new weights): what came before in
        this step's batch no longer matters."""
        self.events = [AllBlocksCleared()]

    def take(self) -> KVEventBatch | None:
        """The events since the last take, as one batch; None if there are none."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return KVEventBatch(time.time(), events)
