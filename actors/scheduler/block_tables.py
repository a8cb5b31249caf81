"""Sequence-level KV memory operations on top of the block managers: grow a table (with
copy-on-write of a shared block), map a cached prefix (from the pool, then the disk tier),
commit full blocks (and store them in the disk tier), fork, release, and swap to and from the
host tier. The device copies these imply are collected here and handed to the next StepPlan by
take_copies(), the disk tier's work by tier.take_work()."""
from __future__ import annotations

from pagewire.wire.kv_transfer import KvLease, KvSource
from pagewire.wire.multimodal import image_spans
from pagewire.wire.to_executor import KvLoad
from pagewire.wire.to_scheduler import CompressResult

from .kv_manager import BlockManager, block_hashes
from .tier_index import TierIndex
from .request import Sequence


class BlockTables:
    def __init__(self, device: BlockManager, host: BlockManager | None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 tier: TierIndex | None = None):
        self.device, self.host, self.tier = device, host, tier
        # What the blocks hold (its K/V storage) roots every hash chain: blocks of another
        # KV dtype (a disk tier's, another engine's) never match.
        self.root = f"kv={kv_cache_dtype}"
        self.window = sliding_window           # every layer's, when they all slide
        self.block_size = device.block_size
        self.copies: list[list[int]] = []      # [src, dst] on the device
        self.pulls: list[KvLoad] = []          # from prefill engines (kv_transfer.py)
        self.leases: dict[str, KvLease] = {}   # ended requests' blocks held for decode engines
        self.new_leases: list[KvLease] = []    # for the next plan
        self.swaps_out: list[list[int]] = []   # [device, host]
        self.swaps_in: list[list[int]] = []    # [host, device]
        self.prefix_queries = 0                # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                   # of which found cached
        self.external_queries = 0              # tokens then looked up in the disk tier or
        self.external_hits = 0                 # asked of a prefill engine; of which loaded

    @classmethod
    def of(cls, config, tier_present: list[bytes] | None = None) -> "BlockTables":
        """The device pool, host tier and disk tier index an EngineConfig asks for."""
        cache = config.cache
        device = BlockManager(cache.num_kv_blocks, cache.block_size, cache.enable_prefix_caching)
        host = BlockManager(cache.num_host_blocks, cache.block_size, enable_caching=False) \
            if cache.num_host_blocks else None
        tier = TierIndex(cache.num_tier_blocks, tier_present or []) \
            if cache.kv_offload_dir else None
        return cls(device, host, config.model.model_info.sliding_window, cache.kv_cache_dtype,
                   tier)

    def reset_prefix_cache(self) -> None:
        """Sleep mode: every block free and nothing cached, on the device and in the host
        tier (no live sequence holds any: the scheduler checks)."""
        for pool in (self.device, self.host):
            if pool is not None:
                pool.reset_prefix_cache()

    def take_copies(self) -> tuple[list, list, list]:
        out = (self.copies, self.swaps_out, self.swaps_in)
        self.copies, self.swaps_out, self.swaps_in = [], [], []
        return out

    def take_pulls(self) -> list[KvLoad]:
        pulls, self.pulls = self.pulls, []
        return pulls

    def grow(self, seq: Sequence, n: int) -> bool:
        """Give seq room to write its next n tokens (after those already planned): new
        blocks, and a private copy of the block it writes first if that one is shared. False,
        changing nothing, if too few blocks are free."""
        index = seq.num_planned // self.block_size
        shared = index < len(seq.block_ids) and self.device.refcount[seq.block_ids[index]] > 1
        need = self.device.blocks_needed(seq.num_planned + n, len(seq.block_ids))
        if need + shared > self.device.num_free:
            return False
        if shared:
            old = seq.block_ids[index]
            fresh = self.device.copy_on_write(old)
            self.copies.append([old, fresh])
            seq.block_ids[index] = fresh
            seq.num_blocks_sent = min(seq.num_blocks_sent, index)
        seq.block_ids += self.device.allocate(need)
        return True

    def map_cached_prefix(self, seq: Sequence) -> bool:
        """For a request holding no blocks: map the longest cached prefix of its tokens. At
        least one token is always left to compute (the step that samples needs it), so a
        block holding the last token is never mapped. Undo with release() if the request
        cannot be admitted after all. True when blocks after those were found in the disk
        tier: fresh blocks are allocated for them and a load planned; seq waits for it."""
        if seq.computes_every_position:
            return False
        self.update_hashes(seq)
        limit = (seq.target_len - 1) // self.block_size
        hits = self.device.lookup(seq.block_hashes[:limit])
        if seq.num_output_tokens == 0:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += len(hits) * self.block_size
        if hits:
            self.device.acquire(hits)
            seq.block_ids, seq.num_committed = hits, len(hits)
            seq.num_computed = len(hits) * self.block_size
        wanted = seq.block_hashes[len(hits):limit]
        transfer = seq.request.transfer
        source = transfer.remote_prefill if transfer is not None else None
        if source is not None:
            return self._pull(seq, wanted, source)
        return self._load_from_tier(seq, wanted)

    def _pull(self, seq: Sequence, wanted: list[bytes], source: KvSource) -> bool:
        """Plan pulling `wanted` from a prefill engine (nothing wanted, the pool had it all:
        the pull only releases the lease). False if the table does not fit: seq waits."""
        targets = self._table_for_load(seq, len(wanted))
        if targets is None:
            return False
        self.external_queries += len(wanted) * self.block_size
        self.pulls.append(KvLoad(seq.seq_id, targets, wanted, source))
        return True

    def _load_from_tier(self, seq: Sequence, wanted: list[bytes]) -> bool:
        """Plan loading the blocks of `wanted` the tier holds. No load if none are there or
        the table does not fit."""
        if self.tier is None or not wanted:
            return False
        self.external_queries += len(wanted) * self.block_size
        found = self.tier.lookup(wanted)
        targets = self._table_for_load(seq, len(found)) if found else None
        if targets is None:
            return False
        self.tier.load(seq.seq_id, targets, found)
        return True

    def _table_for_load(self, seq: Sequence, n: int) -> list[int] | None:
        """Allocate seq's whole table at once, n blocks to load and the rest to compute (a
        sequence that waited for its prefix must not then wait for room, nor hold blocks
        others need while it does); the n blocks to load into, or None (nothing allocated)
        if it does not fit."""
        rest = self.device.blocks_needed(seq.target_len, len(seq.block_ids) + n)
        if n + rest > self.device.num_free:
            return None
        fresh = self.device.allocate(n + rest)
        seq.block_ids = seq.block_ids + fresh
        return fresh[:n]

    def finish_load(self, load: KvLoad, num_ok: int, seq: Sequence | None,
                    step_failed: bool) -> None:
        """A load came back, its first num_ok blocks filled: count them computed and register
        them in the pool (seq None: it ended meanwhile, its blocks are freed)."""
        if load.source is None and not step_failed:   # a failed step kept the tier's hashes
            self.tier.loaded(load.hashes, num_ok)
        if seq is not None:
            seq.num_computed += num_ok * self.block_size
            self.external_hits += num_ok * self.block_size
            self.commit(seq)
            if load.source is not None:
                seq.request.transfer = None           # pulled once (its lease is released)

    def update_hashes(self, seq: Sequence) -> None:
        full = len(seq.token_ids) // self.block_size
        if self.device.enable_caching and len(seq.block_hashes) < full:
            seq.block_hashes = block_hashes(seq.token_ids, self.block_size,
                                            f"{self.root}\x00{seq.request.cache_salt or ''}",
                                            seq.block_hashes,
                                            image_spans(seq.request.images or []))

    def step_computed(self, seq: Sequence, compress: CompressResult | None) -> None:
        """A step's result counted more of seq computed: register its full blocks, free those
        behind the window. `compress`: the result's KV-Compress section (CompressedTables)."""
        self.commit(seq)
        self.drop_behind_window(seq)

    def commit(self, seq: Sequence) -> None:
        """Register the blocks seq has completely computed, so later requests can map them."""
        full = seq.num_computed // self.block_size
        if not self.device.enable_caching or full <= seq.num_committed:
            return
        self.update_hashes(seq)
        events = self.device.events
        stored = []              # the blocks that became findable (for the KV events)
        for i in range(seq.num_committed, full):
            if self.device.commit(seq.block_ids[i], seq.block_hashes[i]) and events is not None:
                stored.append(i)
            if self.tier is not None:
                self.tier.store(seq.block_ids[i], seq.block_hashes[i])
        seq.num_committed = full
        if stored:
            self._report_stored(seq, stored)

    def _report_stored(self, seq: Sequence, stored: list[int]) -> None:
        """One BlockStored per run of consecutive block indexes in `stored`."""
        hashes, size = seq.block_hashes, self.block_size
        start = 0
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k] != stored[k - 1] + 1:
                first, last = stored[start], stored[k - 1]
                self.device.events.stored(hashes[first:last + 1],
                                          hashes[first - 1] if first else None,
                                          seq.token_ids[first * size:(last + 1) * size],
                                          seq.request.lora)
                start = k

    def share(self, child: Sequence) -> None:
        """child, forked from a request, holds a reference to each block of its table."""
        self.device.acquire(child.block_ids[child.num_dropped:])

    def drop_behind_window(self, seq: Sequence) -> None:
        """Free the leading blocks that no query of seq can see again: the next token (at
        position num_computed) sees keys after num_computed - window, and later ones see less."""
        if self.window is None:
            return
        keep_from = max(0, seq.num_computed - self.window) // self.block_size
        if keep_from > seq.num_dropped:
            self.device.free(seq.block_ids[seq.num_dropped:keep_from][::-1])
            seq.num_dropped = keep_from

    def release(self, seq: Sequence) -> None:
        """Drop seq's device and host blocks (tail first: its least shared blocks are then
        evicted first)."""
        self.device.free(seq.block_ids[seq.num_dropped:][::-1])
        if seq.host_block_ids:
            self.host.free(seq.host_block_ids)
        seq.block_ids, seq.host_block_ids = [], []
        seq.num_blocks_sent = seq.num_committed = seq.num_dropped = 0

    def lease(self, seq: Sequence) -> None:
        """Hold an ended seq's computed full blocks for a decode engine to pull, under its
        request id (its other blocks are freed); end_lease() frees them."""
        full = seq.num_committed
        self.device.free(seq.block_ids[full:][::-1])
        lease = KvLease(seq.request.req_id, seq.block_ids[:full], seq.block_hashes[:full])
        self.leases[lease.lease] = lease
        self.new_leases.append(lease)
        seq.block_ids, seq.host_block_ids = [], []
        seq.num_blocks_sent = seq.num_committed = seq.num_dropped = 0

    def end_lease(self, lease_id: str) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.device.free(lease.block_ids[::-1])

    def take_leases(self) -> list[KvLease]:
        leases, self.new_leases = self.new_leases, []
        return leases

    def swap_out(self, seq: Sequence) -> bool:
        """Move seq's blocks to the host tier. False, changing nothing, if the tier is full
        (or seq dropped blocks behind a window: it is recomputed instead)."""
        if self.host is None or seq.num_dropped or len(seq.block_ids) > self.host.num_free:
            return False
        seq.host_block_ids = self.host.allocate(len(seq.block_ids))
        self.swaps_out += [[d, h] for d, h in zip(seq.block_ids, seq.host_block_ids)]
        self.device.free(seq.block_ids[::-1])
        seq.block_ids, seq.num_blocks_sent = [], 0
        return True

    def swap_in(self, seq: Sequence) -> bool:
        """Bring a swapped-out request's blocks back to fresh device blocks."""
        if len(seq.host_block_ids) > self.device.num_free:
            return False
        seq.block_ids = self.device.allocate(len(seq.host_block_ids))
        self.swaps_in += [[h, d] for h, d in zip(seq.host_block_ids, seq.block_ids)]
        self.host.free(seq.host_block_ids)
        seq.host_block_ids = []
        seq.num_committed = 0   # the fresh blocks are not registered; commit() redoes it
        return True
