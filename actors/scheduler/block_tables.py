"""Request-level KV memory operations on top of the block managers: grow a table (with
copy-on-write of a shared block), map a cached prefix (from the pool, then the disk tier),
commit full blocks (and store them in the disk tier), fork, release, and swap to and from the
host tier. The device copies these imply are collected here and handed to the next StepPlan by
take_copies(), the disk tier's work by tier.take_work()."""
from __future__ import annotations

from pagewire.wire.kv_transfer import KvLease, KvSource
from pagewire.wire.to_executor import KvLoad

from .kv_manager import BlockManager, block_hashes
from .tier_index import TierIndex
from .request import Request


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
        device = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        host = BlockManager(config.num_host_blocks, config.block_size, enable_caching=False) \
            if config.num_host_blocks else None
        tier = TierIndex(config.num_tier_blocks, tier_present or []) \
            if config.kv_offload_dir else None
        return cls(device, host, config.model_info.sliding_window, config.kv_cache_dtype, tier)

    def take_copies(self) -> tuple[list, list, list]:
        out = (self.copies, self.swaps_out, self.swaps_in)
        self.copies, self.swaps_out, self.swaps_in = [], [], []
        return out

    def take_pulls(self) -> list[KvLoad]:
        pulls, self.pulls = self.pulls, []
        return pulls

    def grow(self, req: Request, n: int) -> bool:
        """Give req room to write its next n tokens (after those already planned): new
        blocks, and a private copy of the block it writes first if that one is shared. False,
        changing nothing, if too few blocks are free."""
        index = req.num_planned // self.block_size
        shared = index < len(req.block_ids) and self.device.refcount[req.block_ids[index]] > 1
        need = self.device.blocks_needed(req.num_planned + n, len(req.block_ids))
        if need + shared > self.device.num_free:
            return False
        if shared:
            old = req.block_ids[index]
            fresh = self.device.copy_on_write(old)
            self.copies.append([old, fresh])
            req.block_ids[index] = fresh
            req.num_blocks_sent = min(req.num_blocks_sent, index)
        req.block_ids += self.device.allocate(need)
        return True

    def map_cached_prefix(self, req: Request) -> bool:
        """For a request holding no blocks: map the longest cached prefix of its tokens. At
        least one token is always left to compute (the step that samples needs it), so a
        block holding the last token is never mapped. Undo with release() if the request
        cannot be admitted after all. True when blocks after those were found in the disk
        tier: fresh blocks are allocated for them and a load planned; req waits for it."""
        if req.sampling.prompt_logprobs is not None:
            return False  # every prompt position must be computed for its logprobs
        self.update_hashes(req)
        limit = (req.target_len - 1) // self.block_size
        hits = self.device.lookup(req.block_hashes[:limit])
        if req.num_output_tokens == 0:
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += len(hits) * self.block_size
        if hits:
            self.device.acquire(hits)
            req.block_ids, req.num_committed = hits, len(hits)
            req.num_computed = len(hits) * self.block_size
        wanted = req.block_hashes[len(hits):limit]
        source = req.kv_transfer.remote_prefill if req.kv_transfer is not None else None
        if source is not None:
            return self._pull(req, wanted, source)
        return self._load_from_tier(req, wanted)

    def _pull(self, req: Request, wanted: list[bytes], source: KvSource) -> bool:
        """Plan pulling `wanted` from a prefill engine (nothing wanted, the pool had it all:
        the pull only releases the lease). False if the table does not fit: req waits."""
        targets = self._table_for_load(req, len(wanted))
        if targets is None:
            return False
        self.external_queries += len(wanted) * self.block_size
        self.pulls.append(KvLoad(req.seq_id, targets, wanted, source))
        return True

    def _load_from_tier(self, req: Request, wanted: list[bytes]) -> bool:
        """Plan loading the blocks of `wanted` the tier holds. No load if none are there or
        the table does not fit."""
        if self.tier is None or not wanted:
            return False
        self.external_queries += len(wanted) * self.block_size
        found = self.tier.lookup(wanted)
        targets = self._table_for_load(req, len(found)) if found else None
        if targets is None:
            return False
        self.tier.load(req.seq_id, targets, found)
        return True

    def _table_for_load(self, req: Request, n: int) -> list[int] | None:
        """Allocate req's whole table at once, n blocks to load and the rest to compute (a
        sequence that waited for its prefix must not then wait for room, nor hold blocks
        others need while it does); the n blocks to load into, or None (nothing allocated)
        if it does not fit."""
        rest = self.device.blocks_needed(req.target_len, len(req.block_ids) + n)
        if n + rest > self.device.num_free:
            return None
        fresh = self.device.allocate(n + rest)
        req.block_ids = req.block_ids + fresh
        return fresh[:n]

    def finish_load(self, load: KvLoad, num_ok: int, req: Request | None,
                    step_failed: bool) -> None:
        """A load came back, its first num_ok blocks filled: count them computed and register
        them in the pool (req None: it ended meanwhile, its blocks are freed)."""
        if load.source is None and not step_failed:   # a failed step kept the tier's hashes
            self.tier.loaded(load.hashes, num_ok)
        if req is not None:
            req.num_computed += num_ok * self.block_size
            self.external_hits += num_ok * self.block_size
            self.commit(req)
            if load.source is not None:
                req.kv_transfer = None                # pulled once (its lease is released)

    def update_hashes(self, req: Request) -> None:
        full = len(req.token_ids) // self.block_size
        if self.device.enable_caching and len(req.block_hashes) < full:
            req.block_hashes = block_hashes(req.token_ids, self.block_size,
                                            f"{self.root}\x00{req.cache_salt or ''}",
                                            req.block_hashes)

    def commit(self, req: Request) -> None:
        """Register the blocks req has completely computed, so later requests can map them."""
        full = req.num_computed // self.block_size
        if not self.device.enable_caching or full <= req.num_committed:
            return
        self.update_hashes(req)
        for i in range(req.num_committed, full):
            self.device.commit(req.block_ids[i], req.block_hashes[i])
            if self.tier is not None:
                self.tier.store(req.block_ids[i], req.block_hashes[i])
        req.num_committed = full

    def share(self, child: Request) -> None:
        """child, forked from a request, holds a reference to each block of its table."""
        self.device.acquire(child.block_ids[child.num_dropped:])

    def drop_behind_window(self, req: Request) -> None:
        """Free the leading blocks that no query of req can see again: the next token (at
        position num_computed) sees keys after num_computed - window, and later ones see less."""
        if self.window is None:
            return
        keep_from = max(0, req.num_computed - self.window) // self.block_size
        if keep_from > req.num_dropped:
            self.device.free(req.block_ids[req.num_dropped:keep_from][::-1])
            req.num_dropped = keep_from

    def release(self, req: Request) -> None:
        """Drop req's device and host blocks (tail first: its least shared blocks are then
        evicted first)."""
        self.device.free(req.block_ids[req.num_dropped:][::-1])
        if req.host_block_ids:
            self.host.free(req.host_block_ids)
        req.block_ids, req.host_block_ids = [], []
        req.num_blocks_sent = req.num_committed = req.num_dropped = 0

    def lease(self, req: Request) -> None:
        """Hold an ended req's computed full blocks for a decode engine to pull, under its
        request id (its other blocks are freed); end_lease() frees them."""
        full = req.num_committed
        self.device.free(req.block_ids[full:][::-1])
        lease = KvLease(req.seq_id.req, req.block_ids[:full], req.block_hashes[:full])
        self.leases[lease.lease] = lease
        self.new_leases.append(lease)
        req.block_ids, req.host_block_ids = [], []
        req.num_blocks_sent = req.num_committed = req.num_dropped = 0

    def end_lease(self, lease_id: str) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.device.free(lease.block_ids[::-1])

    def take_leases(self) -> list[KvLease]:
        leases, self.new_leases = self.new_leases, []
        return leases

    def swap_out(self, req: Request) -> bool:
        """Move req's blocks to the host tier. False, changing nothing, if the tier is full
        (or req dropped blocks behind a window: it is recomputed instead)."""
        if self.host is None or req.num_dropped or len(req.block_ids) > self.host.num_free:
            return False
        req.host_block_ids = self.host.allocate(len(req.block_ids))
        self.swaps_out += [[d, h] for d, h in zip(req.block_ids, req.host_block_ids)]
        self.device.free(req.block_ids[::-1])
        req.block_ids, req.num_blocks_sent = [], 0
        return True

    def swap_in(self, req: Request) -> bool:
        """Bring a swapped-out request's blocks back to fresh device blocks."""
        if len(req.host_block_ids) > self.device.num_free:
            return False
        req.block_ids = self.device.allocate(len(req.host_block_ids))
        self.swaps_in += [[h, d] for h, d in zip(req.host_block_ids, req.block_ids)]
        self.host.free(req.host_block_ids)
        req.host_block_ids = []
        req.num_committed = 0   # the fresh blocks are not registered; commit() redoes it
        return True
