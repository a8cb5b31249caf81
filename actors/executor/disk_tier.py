"""One executor rank's disk KV tier: block bytes to files and back (kv_tier_files.py names
and frames them; the scheduler's TierIndex decides what is stored, loaded and dropped).

A step's TierWork runs before the step writes any block: the blocks to store are copied out
of the pool at once (their slots may be reused by this very step) and written by a thread
while the model runs; a block still queued is loaded from memory. Files are written under a
temporary name and renamed. A load reads each file, checks it, and fills the pool block; the
first block that is missing or fails its check ends that sequence's load (the rest are
computed), and a corrupt file is removed. Writes past `max_pending` queued bytes (a disk
slower than the steps) are skipped: the index then holds a hash with no file, whose load
fails like a missing one.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import threading

import torch

from pagewire.wire.to_executor import KvLoad, TierWork

from .. import kv_tier_files as files
from .kv_blocks import BlockBytes

log = logging.getLogger(__name__)
MAX_PENDING = 1 << 30        # bytes queued for writing, at most


class DiskTier:
    def __init__(self, directory: str, caches: list[torch.Tensor], tp,
                 max_pending: int = MAX_PENDING):
        """caches: every K/V cache whose blocks the tier keeps, each [2, blocks, ...]."""
        os.makedirs(directory, exist_ok=True)
        self.directory, self.tp, self.max_pending = directory, tp, max_pending
        self.blocks = BlockBytes(caches)
        self.block_bytes = self.blocks.block_bytes
        self.pending: dict[bytes, bytearray] = {}     # hash -> payload not yet on disk
        self.pending_bytes = 0
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                       daemon=True)
        self.writer.start()
        atexit.register(self.flush)

    def run(self, work: TierWork) -> dict:
        """Store, load, drop (TierWork's order). Returns how many leading blocks of each load
        every rank filled."""
        if work.store_ids:
            self._store(work.store_ids, work.store_hashes)
        counts = [self._load(load) for load in work.loads]
        if counts and self.tp.size > 1:
            counts = self.tp.smallest(torch.tensor(counts)).tolist()
        for block_hash in work.drops:
            self.jobs.put(("drop", block_hash))
        return {load.seq_id: n for load, n in zip(work.loads, counts)}

    def flush(self) -> None:
        """Wait until every queued write and removal is done."""
        done = threading.Event()
        self.jobs.put(("flush", done))
        done.wait()

    # -- pool blocks <-> bytes -----------------------------------------------------------------

    def _store(self, block_ids: list[int], hashes: list[bytes]) -> None:
        for block_hash, payload in zip(hashes, self.blocks.read(block_ids)):
            if self.pending_bytes + self.block_bytes > self.max_pending:
                log.warning("disk KV tier: %d bytes queued for writing; skipping stores",
                            self.pending_bytes)
                return
            with self.lock:
                replaced = self.pending.get(block_hash)
                self.pending[block_hash] = payload
                self.pending_bytes += len(payload) - (len(replaced) if replaced else 0)
            self.jobs.put(("store", block_hash))

    def _load(self, load: KvLoad) -> int:
        for n, (block, block_hash) in enumerate(zip(load.block_ids, load.hashes)):
            payload = self._read(block_hash)
            if payload is None:
                return n
            self.blocks.write(block, payload)
        return len(load.block_ids)

    def _read(self, block_hash: bytes) -> bytearray | memoryview | None:
        with self.lock:
            payload = self.pending.get(block_hash)
        if payload is not None:
            return payload
        path = files.file_path(self.directory, block_hash)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except OSError:
            return None
        payload = files.unpack(block_hash, data)
        if payload is None or len(payload) != self.block_bytes:
            log.warning("disk KV tier: %s is damaged or of another layout; removed", path)
            files.remove(path)
            return None
        os.utime(path)                     # recently used: the scan at start orders by mtime
        return payload

    # -- the writer thread ---------------------------------------------------------------------

    def _write_loop(self) -> None:
        torch.set_num_threads(1)   # no second OpenMP team on the step's cores (llm.py)
        while True:
            kind, arg = self.jobs.get()
            try:
                if kind == "store":
                    self._write(arg)
                elif kind == "drop":
                    files.remove(files.file_path(self.directory, arg))
                else:
                    arg.set()
            except OSError as e:       # a full or failing disk: that block is not kept
                log.warning("disk KV tier: %s", e)

    def _write(self, block_hash: bytes) -> None:
        with self.lock:
            payload = self.pending.get(block_hash)
        if payload is None:
            return
        path = files.file_path(self.directory, block_hash)
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "wb") as f:
                f.write(files.header(block_hash, payload))
                f.write(payload)
            os.replace(temporary, path)
        finally:
            with self.lock:
                if self.pending.get(block_hash) is payload:
                    del self.pending[block_hash]
                    self.pending_bytes -= len(payload)
            files.remove(temporary)
