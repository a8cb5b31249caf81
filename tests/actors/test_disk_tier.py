"""The disk KV tier end to end: an executor rank's files (exact bytes back, damaged files
refused and removed), and engines whose working set outgrows the pool: a second round loads
from the tier with the outputs of a recompute, a restarted engine starts with its prefix
cache, and corrupt, torn or foreign files are recomputed around."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire import kv_tier_files as files
from pagewire.executor.disk_tier import DiskTier
from pagewire.executor.parallel import TensorParallel
from pagewire.scheduler.kv_manager import block_hashes
from pagewire.wire.ids import SeqId
from pagewire.wire.to_executor import KvLoad, TierWork


def h(i: int) -> bytes:
    return bytes([i]) * 32


def caches(seed: int) -> list[torch.Tensor]:
    """A float32 and a quantized-KV-like uint8 cache of 6 blocks, random content."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 6, 4, 2, 8, generator=g),
            torch.randint(0, 255, (2, 6, 4, 1, 12), generator=g, dtype=torch.uint8)]


def test_blocks_stored_come_back_exactly_into_other_blocks_from_memory_then_from_disk(tmp_path):
    src, dst = caches(0), caches(1)
    writer = DiskTier(str(tmp_path), src, TensorParallel())
    writer.run(TierWork([4, 1], [h(4), h(1)], [], []))
    reader = DiskTier(str(tmp_path), dst, TensorParallel())
    queued = writer.run(TierWork([], [], [KvLoad(SeqId("q"), [0], [h(4)])], []))
    assert queued == {SeqId("q"): 1}                # read back before or after the write
    writer.flush()
    assert sorted(os.listdir(tmp_path)) == [h(1).hex() + ".kv", h(4).hex() + ".kv"]
    assert files.scan(str(tmp_path)) in ([h(4), h(1)], [h(1), h(4)])
    loaded = reader.run(TierWork([], [], [KvLoad(SeqId("a"), [2, 3], [h(1), h(4)])], []))
    assert loaded == {SeqId("a"): 2}
    for s, d in zip(src, dst):
        assert torch.equal(d[:, 2], s[:, 1]) and torch.equal(d[:, 3], s[:, 4])
    reader.run(TierWork([], [], [], [h(1)]))
    reader.flush()
    assert os.listdir(tmp_path) == [h(4).hex() + ".kv"]


def test_a_load_stops_at_the_first_missing_or_corrupt_block_and_removes_the_corrupt(tmp_path):
    src, dst = caches(0), caches(1)
    tier = DiskTier(str(tmp_path), src, TensorParallel())
    tier.run(TierWork([0, 1, 2], [h(0), h(1), h(2)], [], []))
    tier.flush()
    path = files.file_path(str(tmp_path), h(1))
    with open(path, "r+b") as f:                     # one payload byte flipped
        f.seek(files.HEADER.size + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    before = [c.clone() for c in dst]
    reader = DiskTier(str(tmp_path), dst, TensorParallel())
    loads = [KvLoad(SeqId("a"), [3, 4, 5], [h(0), h(1), h(2)]),
             KvLoad(SeqId("b"), [5], [h(9)])]        # never stored
    assert reader.run(TierWork([], [], loads, [])) == {SeqId("a"): 1, SeqId("b"): 0}
    assert not os.path.exists(path)
    assert all(torch.equal(d[:, 4:], b[:, 4:]) for d, b in zip(dst, before))


def test_the_scan_keeps_whole_files_only(tmp_path):
    tier = DiskTier(str(tmp_path), caches(0), TensorParallel())
    tier.run(TierWork([0, 1], [h(0), h(1)], [], []))
    tier.flush()
    with open(files.file_path(str(tmp_path), h(1)), "r+b") as f:   # torn: cut short
        f.truncate(files.HEADER.size + 10)
    junk = ["notes.txt", h(2).hex() + ".kv", h(3).hex() + ".kv.123.tmp"]
    for name in junk:
        (tmp_path / name).write_bytes(b"x" * 80)
    assert files.scan(str(tmp_path)) == [h(0)]
    assert os.listdir(tmp_path) == [h(0).hex() + ".kv"]


def test_writes_beyond_the_queue_bound_are_skipped(tmp_path, monkeypatch):
    """With the writer held (a disk slower than the steps), a third block past a bound of two
    queued blocks is not stored; the two queued ones are written once the writer goes on."""
    src = caches(0)
    block = sum(c[:, 0].numel() * c.element_size() for c in src)
    tier = DiskTier(str(tmp_path), src, TensorParallel(), max_pending=2 * block)
    go_on, write = threading.Event(), tier._write
    monkeypatch.setattr(tier, "_write", lambda block_hash: (go_on.wait(30), write(block_hash)))
    tier.run(TierWork([0, 1, 2], [h(0), h(1), h(2)], [], []))
    assert (set(tier.pending), tier.pending_bytes) == ({h(0), h(1)}, 2 * block)
    go_on.set()
    tier.flush()
    assert sorted(os.listdir(tmp_path)) == sorted(h(i).hex() + ".kv" for i in (0, 1))
    assert (tier.pending, tier.pending_bytes) == ({}, 0)


# -- engines --------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)


def _prompts(n: int = 6, length: int = 30) -> list[dict]:
    return [{"prompt_token_ids": [3 + 40 * i + j for j in range(length)]} for i in range(n)]


def _outputs(llm: LLM) -> list[tuple[list[int], list]]:
    """Each prompt's greedy tokens and, per token, its 3 likeliest (id, logprob)."""
    outs = [o.outputs[0] for o in llm.generate(_prompts(), GREEDY)]
    return [(o.token_ids, [[(t, lp) for t, _, lp in step.top] for step in o.logprobs])
            for o in outs]


def _assert_same(ours, expected) -> None:
    """The same tokens and alternatives, logprobs equal to float32 rounding (the recompute
    sums in another order: one prefill over the prompt, not a few rows over loaded K/V)."""
    assert len(ours) == len(expected)
    for (tokens, steps), (want_tokens, want_steps) in zip(ours, expected):
        assert tokens == want_tokens
        for step, want in zip(steps, want_steps):
            assert [t for t, _ in step] == [t for t, _ in want]
            assert [lp for _, lp in step] == pytest.approx([lp for _, lp in want], abs=1e-4)


def _engine(path: str, directory: str | None) -> LLM:
    return LLM(path, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=128,
               kv_offload_dir=directory)


def test_a_working_set_larger_than_the_pool_is_served_from_the_tier_and_after_restart(
        tiny_llama, tmp_path):
    path, tmp_path = tiny_llama("gqa2-d64"), tmp_path / "tier"
    expected = _outputs(_engine(path, None))           # 6 x 8 blocks: more than the pool's 40
    first = _engine(path, str(tmp_path))
    _assert_same(_outputs(first), expected)
    tables = first.scheduler.tables
    assert tables.tier.stores == 6 * 8     # every full block (8: 30 prompt + 2 output tokens)
    loaded, cached = tables.tier.hits, tables.prefix_hits // 4
    _assert_same(_outputs(first), expected)
    # Round two: every prompt's 7-block prefix from the pool or the tier, none recomputed.
    loaded, cached = tables.tier.hits - loaded, tables.prefix_hits // 4 - cached
    assert loaded > 0 and loaded + cached >= 6 * 7 and tables.tier.failures == 0
    first.runner.tier.flush()
    (directory,) = os.listdir(tmp_path)
    assert len(os.listdir(tmp_path / directory)) == 6 * 8

    restarted = _engine(path, str(tmp_path))
    _assert_same(_outputs(restarted), expected)
    tier = restarted.scheduler.tables.tier
    # Every prompt's 7-block prefix from disk (and a preempted one's blocks again), nothing
    # computed that needed storing.
    assert tier.hits >= 6 * 7 and tier.stores == 0 and tier.failures == 0


def test_corrupt_torn_and_foreign_files_are_recomputed_around(tiny_llama, tmp_path):
    path, tmp_path = tiny_llama("gqa2-d64"), tmp_path / "tier"
    expected = _outputs(_engine(path, None))
    first = _engine(path, str(tmp_path))
    _outputs(first)
    first.runner.tier.flush()
    (directory,) = tmp_path.iterdir()
    # The first blocks of prompts 0 and 1: every lookup of those prompts starts there.
    corrupt, torn = (files.file_path(str(directory), block_hashes(
        p["prompt_token_ids"], 4, "kv=auto\x00", [])[0]) for p in _prompts()[:2])
    with open(corrupt, "r+b") as f:                   # a payload byte flipped
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    with open(torn, "r+b") as f:                      # cut short, as by a crash
        f.truncate(100)
    (directory / "foreign.bin").write_bytes(b"not a block")
    restarted = _engine(path, str(tmp_path))          # its scan removes the torn and foreign
    assert not os.path.exists(torn) and not (directory / "foreign.bin").exists()
    _assert_same(_outputs(restarted), expected)
    tier = restarted.scheduler.tables.tier
    assert tier.failures == 1                         # the corrupt one, found when loaded
    assert tier.stores == 2                           # both recomputed and stored afresh
    restarted.runner.tier.flush()
    assert len(files.scan(str(directory))) == 6 * 8     # both rewritten whole
