"""Prefix wait: a waiting request whose next blocks another sequence is computing right now
waits for them rather than computing them a second time (`--prefix-wait`).

Prefix caching finds a block only once its K/V are computed and committed (block_tables.commit,
when its step's result is applied, so with two plans in flight only the older plan's blocks
count). Requests sharing a prefix that arrive together (a burst under one system prompt, a
router sending a group to the replica holding its prefix) would each compute that prefix: every
one admitted before the first one's prefill is done. Here a waiting request whose first
uncached full block (by its chained hash: tokens, cache_salt, adapter, KV dtype) is one a
running sequence holds uncommitted is held: skipped in the waiting queue, where it stays (it
counts as waiting; those behind it go ahead in their order). Each admission pass looks again:
once the block is committed the request is admitted as usual, mapping it as a prefix hit
(under chunked prefill as soon as the blocks it shares are, before the other prompt is done),
or held again while its next block is still being computed.

Liveness: the hold is on a running sequence, looked up afresh each pass, so a request whose
computer is aborted, preempted or finished goes ahead on its own (computing what is not
cached). A computer that makes no progress (num_computed unchanged) for STALL_PASSES
admission passes releases the request for good (while it waits), and a pass that would plan
nothing with no plan in flight releases every hold (release_all). Exempt, never held: a
sequence holding blocks (swapped out), a streaming prompt (it is still growing) or one whose
prefix is pulled from a prefill engine (KV transfer), one that computes every position
(prompt logprobs, per-token pooling); a streaming computer holds nobody (it may wait for input indefinitely).

State: one Hold per waiting sequence held (or released for good), by sequence id, dropped
when the sequence is admitted or ends (forget).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagewire.wire.ids import SeqId

from .block_tables import BlockTables
from .request import Sequence, Status

STALL_PASSES = 16   # admission passes without progress of the computer before giving up


@dataclass
class Hold:
    computer: Sequence | None   # the running sequence computing the awaited block
    seen: int                   # its num_computed when it last made progress
    since: int                  # the pass number then
    released: bool = False      # given up: never held again while it waits


class PrefixWait:
    def __init__(self, tables: BlockTables, enabled: bool):
        self.tables = tables
        self.enabled = enabled and tables.device.enable_caching
        self.holds: dict[SeqId, Hold] = {}
        self.passes = 0
        self.num_held = 0        # requests ever held (a counter for tests and benches)
        self._computing: dict[bytes, Sequence] | None = None
        self._running: list[Sequence] = []

    def begin(self, running: list[Sequence]) -> None:
        """A new admission pass over the waiting queue, with these sequences running."""
        self.passes += 1
        self._running, self._computing = running, None

    def holds_back(self, seq: Sequence) -> bool:
        """Whether waiting `seq` waits for a block a running sequence is computing now."""
        if not self.enabled or not self._eligible(seq):
            return False
        hold = self.holds.get(seq.seq_id)
        if hold is not None and hold.released:
            return False
        computer = self._computer_of_next_block(seq)
        if computer is None:
            self.holds.pop(seq.seq_id, None)
            return False
        if hold is None:
            self.num_held += 1
        if hold is None or hold.computer is not computer or hold.seen != computer.num_computed:
            self.holds[seq.seq_id] = Hold(computer, computer.num_computed, self.passes)
        elif self.passes - hold.since > STALL_PASSES:
            self.holds[seq.seq_id] = Hold(None, 0, 0, released=True)
            return False
        return True

    def release_all(self) -> bool:
        """Give up every hold (a pass planned nothing and nothing is in flight); True if any
        request was held."""
        held = [sid for sid, hold in self.holds.items() if not hold.released]
        for sid in held:
            self.holds[sid] = Hold(None, 0, 0, released=True)
        return bool(held)

    def admitted(self, seq: Sequence) -> None:
        """seq runs from this pass on: it computes its uncommitted blocks (those behind it in
        this pass may wait for them), and its hold, if any, goes."""
        self.forget(seq)
        if self._computing is not None:
            self._add_computer(seq)

    def forget(self, seq: Sequence) -> None:
        """seq ended (or was admitted): its hold, if any, goes."""
        if self.holds:
            self.holds.pop(seq.seq_id, None)

    @staticmethod
    def _eligible(seq: Sequence) -> bool:
        req = seq.request
        return (not seq.block_ids and seq.status is Status.WAITING and req.transfer is None
                and req.stream is None and not seq.computes_every_position)

    def _computer_of_next_block(self, seq: Sequence) -> Sequence | None:
        """The running sequence computing seq's first uncached full block (one seq would map,
        so never the block holding its last token), if one is."""
        self.tables.update_hashes(seq)
        limit = (seq.target_len - 1) // self.tables.block_size
        first = len(self.tables.device.lookup(seq.block_hashes[:limit]))
        if first >= limit:
            return None
        return self._computing_now().get(seq.block_hashes[first])

    def _computing_now(self) -> dict[bytes, Sequence]:
        """Uncommitted full blocks of running sequences, by hash (built once a pass)."""
        if self._computing is None:
            self._computing = {}
            for run in self._running:
                self._add_computer(run)
        return self._computing

    def _add_computer(self, run: Sequence) -> None:
        if not run.request.prompt_open:
            for h in run.block_hashes[run.num_committed:]:
                self._computing.setdefault(h, run)
