"""The scheduler's index of the disk KV tier: which block hashes it holds (the executors hold
the bytes, kv_tier_files.py names them), least recently used first, at most `capacity`.

The scheduler decides everything about the tier; this index records it and collects the
step's TierWork. Every block committed to the device pool is stored once (write-through: a
block evicted later, or a restart, finds it there), a prefix lookup that misses the pool
continues here, and a hash past the capacity is dropped (its files deleted). A load the
executors could not complete (a file gone or corrupt) forgets that hash.

Invariant: a hash is in `blocks` from the plan that stores it until the plan that drops it,
and the executors apply plans in order, so a load planned for a hash here finds its bytes
(written, or still queued to be written) unless a file was damaged behind our back.
"""
from __future__ import annotations

from collections import OrderedDict

from pagewire.wire.ids import SeqId
from pagewire.wire.to_executor import KvLoad, TierWork


class TierIndex:
    def __init__(self, capacity: int, present: list[bytes]):
        """present: the hashes found on disk at start, least recently used first."""
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict.fromkeys(present)
        self.work = TierWork([], [], [], [])
        self._trim()
        self.stores = self.loads = self.hits = self.failures = 0   # blocks (metrics)

    def __len__(self) -> int:
        return len(self.blocks)

    def store(self, block: int, block_hash: bytes) -> None:
        """A committed block: stored unless the tier has its content already."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return
        self.blocks[block_hash] = None
        self.work.store_ids.append(block)
        self.work.store_hashes.append(block_hash)
        self.stores += 1
        self._trim()

    def lookup(self, hashes: list[bytes]) -> list[bytes]:
        """The longest prefix of `hashes` held here (each touched)."""
        hits = []
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            hits.append(h)
        return hits

    def load(self, seq_id: SeqId, block_ids: list[int], hashes: list[bytes]) -> None:
        self.work.loads.append(KvLoad(seq_id, block_ids, hashes))
        self.loads += len(hashes)

    def loaded(self, hashes: list[bytes], num_ok: int) -> None:
        """The executors filled the first num_ok blocks of a load. The next one failed (its
        file gone, or removed as damaged) and is forgotten; those after it were not tried
        and stay (a lookup reaches them again once that block is computed and stored)."""
        self.hits += num_ok
        if num_ok < len(hashes):
            self.failures += 1
            self.blocks.pop(hashes[num_ok], None)

    def has_work(self) -> bool:
        return bool(self.work.store_ids or self.work.loads or self.work.drops)

    def take_work(self) -> TierWork | None:
        work = self.work
        if not self.has_work():
            return None
        self.work = TierWork([], [], [], [])
        return work

    def _trim(self) -> None:
        while len(self.blocks) > self.capacity:
            dropped, _ = self.blocks.popitem(last=False)
            self.work.drops.append(dropped)
