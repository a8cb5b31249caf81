"""The KV block manager: counts and maps physical blocks; the scheduler decides.

Invariants, true between calls:
- every block id in [0, num_blocks) is either in the free list or held (refcount >= 1);
- the free list holds no duplicates and no held block.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add to a table of `num_held` blocks so it covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (lowest-numbered first after a fresh start). Raises OutOfBlocks,
        taking none, if fewer than n are free."""
        if n > len(self.free_ids):
            raise OutOfBlocks(f"need {n} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.refcount[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        for i in ids:
            if self.refcount[i] <= 0:
                raise ValueError(f"block {i} freed while not held")
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                self.free_ids.append(i)

    def usage(self) -> float:
        return 1.0 - len(self.free_ids) / self.num_blocks
