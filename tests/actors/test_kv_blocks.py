"""The block manager's prefix cache and block accounting: exact block ids, reference counts
and free-queue (eviction) order, with the module's invariants checked after every test."""
from __future__ import annotations

import hashlib
from array import array

import pytest

from pagewire.scheduler.kv_manager import BlockManager, OutOfBlocks, block_hashes

BS = 4   # block size: small, so prompts stay readable


def check_invariants(kv: BlockManager) -> None:
    """What the module docstring promises between calls."""
    assert len(kv.refcount) == len(kv.hash_of) == kv.num_blocks
    for b in range(kv.num_blocks):
        # every block is free (refcount 0, queued) xor held (refcount >= 1, not queued)
        assert kv.refcount[b] >= 0
        assert (kv.refcount[b] == 0) == (b in kv.free_queue), b
    assert set(kv.free_queue) <= set(range(kv.num_blocks))
    # cached[h] == b exactly when hash_of[b] == h
    for h, b in kv.cached.items():
        assert kv.hash_of[b] == h
    for b, h in enumerate(kv.hash_of):
        if h is not None:
            assert kv.cached[h] == b
    assert len(kv.cached) == sum(h is not None for h in kv.hash_of)
    assert kv.num_free == len(kv.free_queue)


def check_all_free(kv: BlockManager) -> None:
    """Once everything is freed: every id queued exactly once, every refcount 0."""
    check_invariants(kv)
    ids = list(kv.free_queue)
    assert sorted(ids) == list(range(kv.num_blocks)) and len(ids) == len(set(ids))
    assert kv.refcount == [0] * kv.num_blocks
    assert kv.num_free == kv.num_blocks and kv.usage() == 0.0


def h(i: int) -> bytes:
    """A stand-in content hash."""
    return hashlib.sha256(b"test-%d" % i).digest()


# -- prefix cache: commit, free, lookup, acquire -----------------------------------------------

def test_committed_block_stays_findable_after_free_and_can_be_reacquired():
    kv = BlockManager(num_blocks=4, block_size=BS)
    a, b = kv.allocate(2)
    assert (a, b) == (0, 1)
    kv.commit(a, h(0))
    kv.commit(b, h(1))
    assert kv.cached == {h(0): 0, h(1): 1} and kv.hash_of == [h(0), h(1), None, None]
    kv.free([b, a])                                 # tail first
    check_invariants(kv)
    assert list(kv.free_queue) == [2, 3, 1, 0]
    assert kv.refcount == [0, 0, 0, 0]
    assert kv.lookup([h(0), h(1)]) == [0, 1]        # still cached while free
    assert kv.refcount == [0, 0, 0, 0]              # lookup takes no reference
    assert kv.num_evictable([0, 1]) == 2
    kv.acquire([0, 1])                              # a prefix hit: both leave the free queue
    check_invariants(kv)
    assert kv.refcount == [1, 1, 0, 0]
    assert list(kv.free_queue) == [2, 3]
    assert kv.num_evictable([0, 1]) == 0
    assert kv.cached == {h(0): 0, h(1): 1}          # acquire keeps the hashes
    kv.acquire([0])                                 # a second holder of a held block
    assert kv.refcount == [2, 1, 0, 0] and list(kv.free_queue) == [2, 3]
    kv.free([0])
    assert kv.refcount == [1, 1, 0, 0] and list(kv.free_queue) == [2, 3]
    kv.free([1, 0])
    assert list(kv.free_queue) == [2, 3, 1, 0]
    check_all_free(kv)


def test_reacquiring_a_free_block_in_the_middle_of_the_queue_keeps_the_others_order():
    kv = BlockManager(num_blocks=5, block_size=BS)
    ids = kv.allocate(5)
    for i, b in enumerate(ids):
        kv.commit(b, h(i))
    kv.free([3, 1, 4, 0, 2])
    assert list(kv.free_queue) == [3, 1, 4, 0, 2]
    kv.acquire([kv.lookup([h(4)])[0]])
    assert list(kv.free_queue) == [3, 1, 0, 2] and kv.refcount == [0, 0, 0, 0, 1]
    check_invariants(kv)
    kv.free([4])
    assert list(kv.free_queue) == [3, 1, 0, 2, 4]   # rejoins at the end: most recently freed
    check_all_free(kv)


def test_allocate_evicts_least_recently_freed_first():
    kv = BlockManager(num_blocks=4, block_size=BS)
    assert kv.allocate(4) == [0, 1, 2, 3]
    for b in range(4):
        kv.commit(b, h(b))
    kv.free([2])
    kv.free([0])
    kv.free([3])
    kv.free([1])
    assert list(kv.free_queue) == [2, 0, 3, 1]       # free order is eviction order
    assert kv.allocate(1) == [2]
    assert h(2) not in kv.cached and kv.hash_of[2] is None
    assert kv.refcount[2] == 1
    assert kv.cached == {h(0): 0, h(3): 3, h(1): 1}
    check_invariants(kv)
    assert kv.allocate(2) == [0, 3]
    assert kv.cached == {h(1): 1} and kv.hash_of == [None, h(1), None, None]
    assert kv.lookup([h(0)]) == [] and kv.lookup([h(3)]) == []
    assert kv.lookup([h(1)]) == [1]
    assert list(kv.free_queue) == [1]
    check_invariants(kv)
    kv.free([3, 2, 0])                               # caching nothing: reused first
    assert list(kv.free_queue) == [0, 2, 3, 1]
    check_all_free(kv)


def test_evicted_block_is_reused_with_new_content():
    kv = BlockManager(num_blocks=2, block_size=BS)
    (b,) = kv.allocate(1)
    kv.commit(b, h(0))
    kv.free([b])
    assert list(kv.free_queue) == [1, 0]
    assert kv.allocate(2) == [1, 0]                  # 0 evicted last: it was freed last
    assert kv.cached == {} and kv.hash_of == [None, None]
    kv.commit(0, h(5))
    assert kv.cached == {h(5): 0}
    kv.free([0, 1])
    assert kv.lookup([h(0)]) == [] and kv.lookup([h(5)]) == [0]
    assert list(kv.free_queue) == [1, 0]             # unhashed 1 first: evicting it loses nothing
    check_all_free(kv)


def test_a_held_block_is_never_evicted_even_when_the_pool_is_otherwise_full():
    kv = BlockManager(num_blocks=3, block_size=BS)
    assert kv.allocate(3) == [0, 1, 2]
    kv.commit(1, h(1))
    kv.free([0, 2])                                  # block 1 (cached) stays held
    assert list(kv.free_queue) == [2, 0] and kv.refcount == [0, 1, 0]
    with pytest.raises(OutOfBlocks):
        kv.allocate(3)
    # a refused allocate takes nothing
    assert list(kv.free_queue) == [2, 0] and kv.refcount == [0, 1, 0]
    assert kv.cached == {h(1): 1}
    check_invariants(kv)
    assert kv.allocate(2) == [2, 0]
    assert kv.num_free == 0
    with pytest.raises(OutOfBlocks):
        kv.allocate(1)
    assert kv.refcount == [1, 1, 1] and kv.cached == {h(1): 1} and kv.lookup([h(1)]) == [1]
    check_invariants(kv)
    kv.free([2, 1, 0])
    assert list(kv.free_queue) == [0, 2, 1]
    check_all_free(kv)


def test_a_shared_cached_block_survives_one_holder_freeing_it():
    kv = BlockManager(num_blocks=2, block_size=BS)
    (b,) = kv.allocate(1)
    kv.commit(b, h(0))
    kv.acquire([b])                                  # a second request hits it
    assert kv.refcount == [2, 0]
    kv.free([b])
    assert kv.refcount == [1, 0] and list(kv.free_queue) == [1]
    with pytest.raises(OutOfBlocks):
        kv.allocate(2)
    assert kv.allocate(1) == [1] and kv.cached == {h(0): 0}
    kv.free([1, 0])
    check_all_free(kv)


def test_lookup_returns_only_the_longest_prefix():
    kv = BlockManager(num_blocks=6, block_size=BS)
    ids = kv.allocate(4)
    assert ids == [0, 1, 2, 3]
    kv.commit(0, h(0))
    kv.commit(1, h(1))
    kv.commit(3, h(3))                               # h(2) is never committed: a gap
    assert kv.lookup([h(0), h(1), h(2), h(3)]) == [0, 1]
    assert kv.lookup([h(0), h(1)]) == [0, 1]
    assert kv.lookup([h(0)]) == [0]
    assert kv.lookup([h(1), h(0)]) == [1, 0]         # a hit is by hash, in the order asked
    assert kv.lookup([h(2), h(3)]) == []             # a miss at the start finds nothing
    assert kv.lookup([h(3)]) == [3]
    assert kv.lookup([]) == []
    assert kv.refcount == [1, 1, 1, 1, 0, 0]         # no references taken
    check_invariants(kv)
    kv.free([3, 2, 1, 0])
    assert kv.lookup([h(0), h(1), h(2), h(3)]) == [0, 1]
    check_all_free(kv)


def test_commit_of_content_already_cached_elsewhere_leaves_the_block_unhashed():
    kv = BlockManager(num_blocks=3, block_size=BS)
    a, b = kv.allocate(2)
    kv.commit(a, h(7))
    kv.commit(b, h(7))                               # the same content, computed twice
    assert kv.cached == {h(7): a} and kv.hash_of == [h(7), None, None]
    kv.commit(a, h(8))                               # an already hashed block keeps its hash
    assert kv.cached == {h(7): a} and kv.hash_of == [h(7), None, None]
    check_invariants(kv)
    kv.free([b])
    assert kv.lookup([h(7)]) == [a]
    assert list(kv.free_queue) == [1, 2]             # unhashed b first, before never-used 2
    assert kv.allocate(2) == [1, 2]                  # evicting unhashed b touches no hash
    assert kv.cached == {h(7): a}
    check_invariants(kv)
    kv.free([2, 1, 0])
    check_all_free(kv)


def test_without_caching_lookup_finds_nothing_and_commit_records_nothing():
    kv = BlockManager(num_blocks=3, block_size=BS, enable_caching=False)
    ids = kv.allocate(2)
    kv.commit(ids[0], h(0))
    kv.commit(ids[1], h(1))
    assert kv.cached == {} and kv.hash_of == [None, None, None]
    assert kv.lookup([h(0), h(1)]) == []
    kv.free(ids[::-1])
    assert kv.lookup([h(0)]) == []
    assert list(kv.free_queue) == [0, 1, 2]          # written before, so reused before 2
    check_all_free(kv)


def test_lookup_ignores_cache_when_disabled_even_if_cached_was_filled():
    kv = BlockManager(num_blocks=2, block_size=BS, enable_caching=False)
    kv.cached[h(0)] = 0                              # even a (foreign) entry is not looked at
    kv.hash_of[0] = h(0)
    assert kv.lookup([h(0)]) == []
    check_all_free(kv)


# -- copy on write -----------------------------------------------------------------------------

def test_copy_on_write_for_a_sole_holder_is_none():
    kv = BlockManager(num_blocks=3, block_size=BS)
    (b,) = kv.allocate(1)
    assert kv.copy_on_write(b) is None
    assert kv.refcount == [1, 0, 0] and list(kv.free_queue) == [1, 2]
    check_invariants(kv)
    kv.free([b])
    check_all_free(kv)


def test_copy_on_write_for_a_shared_block_moves_a_reference_to_a_fresh_block():
    kv = BlockManager(num_blocks=4, block_size=BS)
    (b,) = kv.allocate(1)
    kv.commit(b, h(0))
    kv.acquire([b, b])                               # three holders
    assert kv.refcount == [3, 0, 0, 0]
    assert kv.copy_on_write(b) == 1
    assert kv.refcount == [2, 1, 0, 0] and list(kv.free_queue) == [2, 3]
    assert kv.hash_of == [h(0), None, None, None]    # the fresh block carries no hash
    check_invariants(kv)
    assert kv.copy_on_write(b) == 2
    assert kv.refcount == [1, 1, 1, 0]
    assert kv.copy_on_write(b) is None               # now a sole holder
    assert kv.refcount == [1, 1, 1, 0]
    kv.free([2, 1, 0])                               # the copies cache nothing: first
    assert list(kv.free_queue) == [1, 2, 3, 0]
    check_all_free(kv)


def test_copy_on_write_evicts_the_least_recently_freed_cached_block():
    kv = BlockManager(num_blocks=3, block_size=BS)
    assert kv.allocate(3) == [0, 1, 2]
    kv.commit(1, h(1))
    kv.commit(2, h(2))
    kv.free([2])
    kv.free([1])
    kv.acquire([0])
    assert kv.copy_on_write(0) == 2                  # 2 was freed first
    assert kv.cached == {h(1): 1} and kv.refcount == [1, 0, 1]
    check_invariants(kv)
    kv.free([2, 0])
    check_all_free(kv)


def test_copy_on_write_with_no_free_block_raises_and_keeps_the_reference():
    kv = BlockManager(num_blocks=2, block_size=BS)
    a, b = kv.allocate(2)
    kv.acquire([a])
    with pytest.raises(OutOfBlocks):
        kv.copy_on_write(a)
    assert kv.refcount == [2, 1]
    check_invariants(kv)
    kv.free([a, a, b])
    check_all_free(kv)


# -- counting ----------------------------------------------------------------------------------

def test_num_evictable_counts_free_blocks_only():
    kv = BlockManager(num_blocks=4, block_size=BS)
    a, b, c = kv.allocate(3)
    for i, blk in enumerate((a, b, c)):
        kv.commit(blk, h(i))
    kv.free([c, a])
    assert kv.num_evictable(kv.lookup([h(0), h(1), h(2)])) == 2
    assert kv.num_evictable([]) == 0
    kv.free([b])
    assert kv.num_evictable([0, 1, 2]) == 3
    check_all_free(kv)


@pytest.mark.parametrize("tokens, held, needed", [
    (0, 0, 0), (1, 0, 1), (4, 0, 1), (5, 0, 2), (8, 2, 0), (9, 2, 1), (12, 1, 2), (3, 5, 0)])
def test_blocks_needed(tokens, held, needed):
    kv = BlockManager(num_blocks=8, block_size=BS)
    assert kv.blocks_needed(tokens, held) == needed
    check_all_free(kv)


# -- block_hashes ------------------------------------------------------------------------------

def test_hashes_are_sha256_of_the_parent_and_the_block_tokens():
    tokens = list(range(10, 22))                     # 3 full blocks of 4
    got = block_hashes(tokens, BS, None, [])
    assert len(got) == 3 and all(isinstance(x, bytes) and len(x) == 32 for x in got)
    parent = hashlib.sha256(b"pagewire-kv\0").digest()
    want = []
    for i in range(0, 12, BS):
        parent = hashlib.sha256(parent + array("q", tokens[i:i + BS]).tobytes()).digest()
        want.append(parent)
    assert got == want
    salted = block_hashes(tokens, BS, "s", [])
    assert salted[0] == hashlib.sha256(hashlib.sha256(b"pagewire-kv\0s").digest()
                                       + array("q", tokens[:BS]).tobytes()).digest()


def test_equal_prefixes_give_equal_hashes():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], BS, None, [])
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96], BS, None, [])
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]
    assert b[2] not in a
    assert block_hashes([1, 2, 3, 4], BS, None, []) == a[:1]
    assert block_hashes([1, 2, 3, 4], BS, "", []) == a[:1]    # empty salt == no salt


def test_hashes_chain_changing_block_0_changes_every_later_hash():
    base = list(range(100, 116))
    changed = [999] + base[1:]
    a, b = block_hashes(base, BS, None, []), block_hashes(changed, BS, None, [])
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b))
    # changing only block 2 leaves blocks 0 and 1 equal
    c = block_hashes(base[:8] + [0] + base[9:], BS, None, [])
    assert c[:2] == a[:2] and c[2] != a[2] and c[3] != a[3]
    # the same block content at a different position hashes differently
    same = [5, 5, 5, 5] * 3
    s = block_hashes(same, BS, None, [])
    assert len(set(s)) == 3


def test_a_different_salt_gives_all_different_hashes():
    tokens = list(range(16))
    plain = block_hashes(tokens, BS, None, [])
    one, two = block_hashes(tokens, BS, "tenant-a", []), block_hashes(tokens, BS, "tenant-b", [])
    assert len(plain) == len(one) == len(two) == 4
    assert not set(plain) & set(one) and not set(one) & set(two) and not set(plain) & set(two)
    assert block_hashes(tokens, BS, "tenant-a", []) == one   # deterministic


def test_partial_trailing_blocks_are_not_hashed():
    assert block_hashes([], BS, None, []) == []
    assert block_hashes([1, 2, 3], BS, None, []) == []
    full = block_hashes([1, 2, 3, 4], BS, None, [])
    assert len(full) == 1
    assert block_hashes([1, 2, 3, 4, 5, 6, 7], BS, None, []) == full
    assert len(block_hashes(list(range(8)), BS, None, [])) == 2
    assert len(block_hashes(list(range(33)), 16, None, [])) == 2


@pytest.mark.parametrize("salt", [None, "x"])
def test_incremental_extension_equals_computing_from_scratch(salt):
    tokens = list(range(50, 73))                     # 23 tokens: 5 full blocks and 3 more
    scratch = block_hashes(tokens, BS, salt, [])
    assert len(scratch) == 5
    for cut in range(0, len(tokens) + 1):
        start = block_hashes(tokens[:cut], BS, salt, [])
        assert len(start) == cut // BS
        assert block_hashes(tokens, BS, salt, start) == scratch
    # extending step by step, a token at a time, as a decode does
    hashes: list[bytes] = []
    for n in range(1, len(tokens) + 1):
        hashes = block_hashes(tokens[:n], BS, salt, hashes)
    assert hashes == scratch
    # `start` is not mutated
    start = scratch[:2]
    block_hashes(tokens, BS, salt, start)
    assert start == scratch[:2]


def test_hashes_and_manager_together_share_a_prompt_prefix():
    """Two prompts with one common full block share exactly that block."""
    kv = BlockManager(num_blocks=6, block_size=BS)
    p1 = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    h1 = block_hashes(p1, BS, None, [])
    t1 = kv.allocate(kv.blocks_needed(len(p1), 0))
    assert t1 == [0, 1, 2]
    for blk, hh in zip(t1, h1):
        kv.commit(blk, hh)
    assert kv.hash_of[:3] == [h1[0], h1[1], None]
    p2 = [1, 2, 3, 4, 50, 60, 70, 80, 90, 100]
    h2 = block_hashes(p2, BS, None, [])
    hit = kv.lookup(h2)
    assert hit == [0]
    kv.acquire(hit)
    t2 = hit + kv.allocate(kv.blocks_needed(len(p2), len(hit)))
    assert t2 == [0, 3, 4]
    assert kv.refcount == [2, 1, 1, 1, 1, 0]
    # a salted request with the same tokens shares nothing
    assert kv.lookup(block_hashes(p1, BS, "other", [])) == []
    check_invariants(kv)
    kv.free(t1[::-1])
    kv.free(t2[::-1])
    # the unhashed tails (2, then 4 and 3) first, never-used 5, then the cached 1 and 0
    assert list(kv.free_queue) == [3, 4, 2, 5, 1, 0]
    check_all_free(kv)
