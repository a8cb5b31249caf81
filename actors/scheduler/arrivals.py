"""Sequences waiting for blocks to arrive (Status.LOADING): from the disk tier, filled by the
executor in the step that carries the load (its StepResult says how many came), or pulled
from a prefill engine by a thread of the executor while steps go on (a KvPulled message
says). The scheduler puts each back in line when its blocks came, with what came counted
computed (block_tables.finish_load).

Invariant: a pull's blocks are written by the puller's thread until KvPulled, so a sequence
that ends while pulling gives its blocks back only then (held here meanwhile).
"""
from __future__ import annotations

from pagewire.wire.ids import SeqId
from pagewire.wire.kv_transfer import KvPulled
from pagewire.wire.to_executor import KvLoad, StepPlan
from pagewire.wire.to_scheduler import TierResult

from .block_tables import BlockTables
from .request import Sequence, Status


class Arrivals:
    def __init__(self, tables: BlockTables):
        self.tables = tables
        self.loading: dict[SeqId, Sequence] = {}
        # Pulls under way, with the blocks of a sequence that ended meanwhile.
        self.pulling: dict[SeqId, tuple[KvLoad, list[int] | None]] = {}

    def wait(self, seq: Sequence) -> None:
        """seq's blocks will arrive (map_cached_prefix planned their load or pull)."""
        seq.status, self.loading[seq.seq_id] = Status.LOADING, seq

    def planned(self, pulls: list[KvLoad]) -> None:
        self.pulling.update((load.seq_id, (load, None)) for load in pulls)

    def abandon(self, seq: Sequence) -> None:
        """A waiting seq ends: it stops waiting, and keeps no blocks a pull may still write
        (they are freed when the pull ends)."""
        del self.loading[seq.seq_id]
        if seq.seq_id in self.pulling:
            self.pulling[seq.seq_id] = (self.pulling[seq.seq_id][0], seq.block_ids)
            seq.block_ids = []

    def tier_loaded(self, plan: StepPlan, tier: TierResult | None,
                    step_failed: bool) -> list[Sequence]:
        """The step's disk-tier loads came back (its result's tier section): their sequences,
        to put back in line."""
        loaded = tier.kv_loaded if tier is not None else {}
        loads = plan.tier.loads if plan.tier is not None else []
        back = [self._arrived(load, loaded.get(load.seq_id, 0), step_failed) for load in loads]
        return [seq for seq in back if seq is not None]

    def pulled(self, msg: KvPulled) -> list[tuple[Sequence, KvLoad, bool]]:
        """A plan's pulls ended: (sequence to put back in line, its pull, whether it came
        short) for each still waiting."""
        back = []
        for seq_id, num_ok in msg.loaded.items():
            load, orphaned = self.pulling.pop(seq_id, (None, None))
            if orphaned is not None:
                self.tables.device.free(orphaned[::-1])
            elif load is not None:
                seq = self._arrived(load, num_ok, False)
                if seq is not None:
                    back.append((seq, load, num_ok < len(load.hashes)))
        return back

    def _arrived(self, load: KvLoad, num_ok: int, step_failed: bool) -> Sequence | None:
        seq = self.loading.pop(load.seq_id, None)
        self.tables.finish_load(load, num_ok, seq, step_failed)
        return seq
