"""The scheduler's admission and preemption policy: which waiting sequences join the running
ones in a step, and how a preempted one gives way. The Scheduler (scheduler.py) plans each
step: running sequences first, then it asks admit() for waiting ones under what is left of
the token budget, and it decides when to preempt; this module holds the rules.

Admission goes in (priority, arrival) order. A waiting prompt first maps whatever prefix of
it is cached: in the pool, then in the disk tier or, for a decode after a remote prefill, its
prefill engine's lease (those blocks are filled by the next step while the request waits,
LOADING, with its whole table allocated; block_tables.py). One whose next blocks a running
sequence is computing waits for them, skipped in the queue (prefix_wait.py), and so is one
whose adapter would make the running sequences' adapters more than max_loras. Under the
priority policy, a waiting head that lacks the blocks for its next chunk makes running
sequences of lower priority give way (priority_victim).

A preempted sequence is swapped to the host tier when the policy allows and it fits, else
recomputed (freed, requeued, prefilled again, cheaply when its blocks are still cached).
"""
from __future__ import annotations

from ..config import EngineConfig
from ..config_sections import PRIORITY, RECOMPUTE
from .arrivals import Arrivals
from .block_tables import BlockTables
from .encoder_budget import EncoderBudget
from .live_requests import LiveRequests
from .prefix_wait import PrefixWait
from .request import Sequence, Status


class AdmissionPolicy:
    """Reads and changes the scheduler's queues (`live`) and block tables in place; holds no
    state of its own."""

    def __init__(self, config: EngineConfig, live: LiveRequests, tables: BlockTables,
                 arrivals: Arrivals, prefix_wait: PrefixWait):
        self.config = config
        self.live, self.tables = live, tables
        self.arrivals, self.prefix_wait = arrivals, prefix_wait
        self.by_priority = config.scheduler.scheduling_policy == PRIORITY

    def admit(self, budget: int, encoder_rows: EncoderBudget,
              first_scheduled: list[float]) -> list[Sequence]:
        """Waiting sequences that start (or resume) in this step, in admission order. One whose
        adapter would make the running sequences' adapters more than max_loras waits, and
        those behind it go ahead, and so do they behind one waiting for blocks a running
        sequence is computing (prefix_wait.py). Appends to `first_scheduled` the arrival time
        of each request that runs for the first time."""
        running, waiting = self.live.running, self.live.waiting
        admitted, i = [], 0
        self.prefix_wait.begin(running)
        loras = {r.request.lora.id for r in running if r.request.lora is not None}
        while i < len(waiting) and budget > 0 and \
                len(running) < self.config.scheduler.max_num_seqs:
            seq = waiting[i]
            lora = seq.request.lora.id if seq.request.lora is not None else None
            if lora is not None and lora not in loras and len(loras) >= self.config.lora.max_loras:
                i += 1
                continue
            if seq.status is Status.SWAPPED:
                if not self.tables.swap_in(seq):
                    break
                seq.status = Status.WAITING    # blocks back on the device; first in line
            if self.prefix_wait.holds_back(seq):
                i += 1
                continue
            fresh = not seq.block_ids
            if fresh and self.tables.map_cached_prefix(seq):   # it waits for its blocks
                waiting.pop(i)
                self.arrivals.wait(seq)
                continue
            transfer = seq.request.transfer
            if fresh and transfer is not None and transfer.remote_prefill:
                self._forget_blocks(seq)      # no room yet to pull its prefill engine's blocks
                break
            n = seq.num_pending
            if n == 0 and seq.request.prompt_open:     # all it has is its held-back last token
                if fresh:
                    self._forget_blocks(seq)
                i += 1
                continue
            if n > budget and not self.config.scheduler.enable_chunked_prefill:
                n = 0
            n = encoder_rows.cut(seq, min(n, budget))
            if n == 0 or not self.tables.grow(seq, n):
                if fresh:                      # give back the cached prefix it mapped
                    self._forget_blocks(seq)
                break
            waiting.pop(i)
            self.prefix_wait.admitted(seq)
            if lora is not None:
                loras.add(lora)
            seq.status, seq.num_scheduled = Status.RUNNING, n
            if not seq.request.scheduled_before:
                seq.request.scheduled_before = True
                first_scheduled.append(seq.request.arrival_time)
            self.live.enqueue(seq)
            admitted.append(seq)
            budget -= n
        return admitted

    def release_waiting_blocks(self) -> bool:
        """Nothing runs or will (no plan in flight either: the caller checks): if waiting
        sequences hold device blocks (loaded from the disk tier, swapped in) that the first in
        line needs, they give them back (and recompute from the prefix cache) rather than wait
        on each other forever."""
        if self.live.running or self.arrivals.loading:
            return False
        holders = [r for r in self.live.waiting if r.block_ids and r.status is Status.WAITING]
        for seq in holders:
            self._forget_blocks(seq)
        return bool(holders)

    def priority_victim(self) -> Sequence | None:
        """Under the priority policy, the running sequence to preempt (the last, of lower
        priority than the first waiting one) while that one lacks the blocks for its next
        chunk; None when nobody need give way."""
        running, waiting = self.live.running, self.live.waiting
        if not (self.by_priority and waiting and running) or \
                running[-1].request.priority <= waiting[0].request.priority:
            return None
        head, kv = waiting[0], self.tables.device
        chunk = min(head.num_pending, self.config.scheduler.max_num_batched_tokens)
        need = kv.blocks_needed(chunk + head.num_computed, len(head.block_ids))
        if need + len(head.host_block_ids) <= kv.num_free \
                and len(running) < self.config.scheduler.max_num_seqs:
            return None
        return running[-1]

    def give_way(self, seq: Sequence) -> Status:
        """The blocks of seq, preempted (out of the running queue, dropped from the executor):
        swapped out when the preemption mode allows and the host tier has room (SWAPPED), else
        freed for a recompute (WAITING). Returns its new status."""
        mode = self.config.cache.preemption_mode
        # a per-token pooled prompt's rows computed so far are the executor's, and it forgets
        # them with the sequence: it recomputes (wire/pooling.py PoolingSeq)
        pooling = seq.request.pooling
        if pooling is not None and pooling.per_token:
            mode = RECOMPUTE
        if mode != RECOMPUTE and self.tables.swap_out(seq):
            return Status.SWAPPED
        self._forget_blocks(seq)
        return Status.WAITING

    def _forget_blocks(self, seq: Sequence) -> None:
        """Give back seq's device blocks: it computes from its first token again (cheaply,
        where its blocks stay in the prefix cache)."""
        self.tables.release(seq)
        seq.num_computed = 0
