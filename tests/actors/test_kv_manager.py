"""The block manager's verbs, with exact block ids and reference counts."""
from __future__ import annotations

import pytest

from pagewire.scheduler.kv_manager import BlockManager, OutOfBlocks


def assert_whole(kv: BlockManager) -> None:
    assert sorted(kv.free_queue) == list(range(kv.num_blocks))
    assert not any(kv.refcount)


def test_allocate_takes_lowest_ids_and_reuses_freed_blocks_first():
    kv = BlockManager(num_blocks=6, block_size=16)
    assert kv.allocate(2) == [0, 1]
    assert kv.allocate(3) == [2, 3, 4]
    assert kv.refcount == [1, 1, 1, 1, 1, 0]
    kv.free([3, 2])                       # a table's tail first; they cache nothing
    assert list(kv.free_queue) == [2, 3, 5]
    assert kv.allocate(2) == [2, 3]       # written before: reused before never-used 5
    kv.free([0, 1, 2, 3, 4])
    assert_whole(kv)


def test_allocate_beyond_free_takes_nothing():
    kv = BlockManager(num_blocks=3, block_size=16)
    kv.allocate(2)
    with pytest.raises(OutOfBlocks):
        kv.allocate(2)
    assert kv.num_free == 1
    kv.free([0, 1])
    assert_whole(kv)


def test_double_free_is_refused():
    kv = BlockManager(num_blocks=2, block_size=16)
    (b,) = kv.allocate(1)
    kv.free([b])
    with pytest.raises(ValueError):
        kv.free([b])
    assert_whole(kv)


@pytest.mark.parametrize("tokens, held, needed", [
    (0, 0, 0), (1, 0, 1), (16, 0, 1), (17, 0, 2), (17, 1, 1), (32, 2, 0), (33, 2, 1), (5, 3, 0)])
def test_blocks_needed(tokens, held, needed):
    assert BlockManager(8, 16).blocks_needed(tokens, held) == needed


def test_usage():
    kv = BlockManager(num_blocks=4, block_size=16)
    kv.allocate(1)
    assert kv.usage() == 0.25
