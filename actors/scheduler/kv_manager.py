"""The KV block manager: counts and maps physical blocks; the scheduler decides.

Verbs: allocate, acquire, free, lookup, commit, and copy_on_write. Prefix caching lives here
too: a full block whose content hash is committed stays findable by that hash after it is
freed, until allocate() evicts it (least recently freed first).

Invariants, true between calls:
- every block is either free (refcount 0, in free_queue) or held (refcount >= 1, not in it);
- cached[h] == b exactly when hash_of[b] == h; a cached block may be free or held;
- free_queue's order is eviction order: allocate() takes from its front; free() appends a
  block that caches content and puts one that caches none at the front, so a freed block that
  holds nothing findable is reused before a never-used one (its memory is already backed: a
  first write into the pool's huge pages costs milliseconds a page) or a cached one.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    pass


def block_hashes(token_ids: list[int], block_size: int, salt: str | None,
                 start: list[bytes], images: list[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """Extend `start` (hashes of the first len(start) blocks) to every full block of
    token_ids. A block's hash chains its parent's, so equal hashes mean equal prefixes; the
    salt seeds the chain, so differently salted requests never share. SHA-256: a crafted
    prompt cannot collide with another's blocks. `images` (offset, length, digest): a block
    holding some of an image's rows hashes the image's digest too (the rows' tokens are one
    placeholder whatever the image)."""
    hashes = list(start)
    parent = hashes[-1] if hashes else hashlib.sha256(b"pagewire-kv\0" + (salt or "").encode()).digest()
    for i in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        seen = b"".join(digest for offset, length, digest in images
                        if offset < i + block_size and offset + length > i)
        parent = hashlib.sha256(parent + array("q", token_ids[i:i + block_size]).tobytes()
                                + seen).digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        self.refcount = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.events = None         # a KvEventLog when KV events are published (kv_event_log.py)

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out (free ones, cached or not)."""
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add to a table of `num_held` blocks so it covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks, evicting whatever content they cached. Raises OutOfBlocks,
        taking none, if fewer than n are free."""
        if n > len(self.free_queue):
            raise OutOfBlocks(f"need {n} blocks, {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            if self.hash_of[block] is not None:
                del self.cached[self.hash_of[block]]
                if self.events is not None:
                    self.events.removed(self.hash_of[block])
                self.hash_of[block] = None
            self.refcount[block] = 1
            ids.append(block)
        return ids

    def acquire(self, ids: list[int]) -> None:
        """Add a reference to each held or cached block (a prefix hit, or a fork sharing a
        table). A free cached block leaves the free queue."""
        for block in ids:
            if self.refcount[block] == 0:
                del self.free_queue[block]
            self.refcount[block] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block. Blocks reaching zero join the end of the free
        queue, keeping their hash: reusable until evicted. Callers pass a table tail first, so
        a sequence's last blocks (the least shared) are evicted before its prefix. A block
        caching nothing goes to the front instead (evicting it loses nothing)."""
        for block in ids:
            if self.refcount[block] <= 0:
                raise ValueError(f"block {block} freed while not held")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free_queue[block] = None
                if self.hash_of[block] is None:
                    self.free_queue.move_to_end(block, last=False)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks caching the longest prefix of `hashes`. Takes no reference."""
        hits = []
        if self.enable_caching:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                hits.append(block)
        return hits

    def num_evictable(self, ids: list[int]) -> int:
        """How many of these blocks are free (acquiring them uses up free capacity)."""
        return sum(1 for b in ids if self.refcount[b] == 0)

    def commit(self, block: int, content: bytes) -> bool:
        """Record that held `block` is full with `content`. If another block already caches
        that content, this one stays unhashed (it is freed like any other). True when the
        content became findable."""
        if self.enable_caching and content not in self.cached and self.hash_of[block] is None:
            self.cached[content] = block
            self.hash_of[block] = content
            return True
        return False

    def copy_on_write(self, block: int) -> int | None:
        """Before writing into a held `block`: if others share it, give the writer a fresh
        block and return its id (the caller copies the content and swaps it into its table);
        return None if the writer is its only holder."""
        if self.refcount[block] <= 1:
            return None
        (fresh,) = self.allocate(1)
        self.refcount[block] -= 1
        return fresh

    def reset_prefix_cache(self) -> None:
        """Forget every cached content (sleep mode: the pool's bytes are gone, or were computed
        by other weights). Only with every block free: a held block's content is a live
        sequence's."""
        if len(self.free_queue) != self.num_blocks:
            raise RuntimeError(f"{self.num_blocks - len(self.free_queue)} blocks still held")
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        if self.events is not None:          # subscribers forget this pool's blocks too
            self.events.cleared()

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks
