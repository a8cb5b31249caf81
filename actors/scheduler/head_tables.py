"""KV-Compress's block accounting (--kv-compress-rate): a sequence's blocks hold its head rows
(layer x KV head), each keeping its own tokens, so after a compression its table shrinks.

A block is H = layers x KV heads sub-blocks, any of which may serve any of the sequence's rows
(executor/head_blocks.py packs them). Rows holding lens[i] tokens need `blocks_for(lens)`
blocks: the executor and this table count alike. Until its first compression every row holds
all of a sequence's tokens; a compression's result gives the rows' lengths (covering the
tokens then computed, `heads_at`), and the table keeps that many blocks, freeing the rest.

When: a step compresses a sequence when it samples (its known tokens all computed) and at
least `window` tokens were computed since the last compression (or since it began). While
that step runs the sequence plans nothing more (Sequence.num_pending is 0): the next plan's
table depends on the result.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagewire.wire.to_scheduler import CompressResult

from .block_tables import BlockTables
from .kv_manager import BlockManager
from .request import Sequence


@dataclass(slots=True)
class CompressState:
    """A sequence's compression (Sequence.compress), made when its table first grows under
    KV-Compress, dropped with its blocks. `head_lens`: its head rows' lengths after its latest
    compression (None: none yet), covering its first `heads_at` tokens; `next`: the next plan
    compresses it; `in_flight`: a plan in flight does."""
    head_lens: list[int] | None = None
    heads_at: int = 0
    next: bool = False
    in_flight: bool = False


def blocks_for(lens, block_size: int) -> int:
    """Blocks holding rows of these lengths."""
    subs = sum(-(-int(n) // block_size) for n in lens)
    return -(-subs // len(lens))


class CompressedTables(BlockTables):
    def __init__(self, device: BlockManager, rows: int, window: int,
                 kv_cache_dtype: str = "auto"):
        super().__init__(device, None, None, kv_cache_dtype)
        self.rows, self.every = rows, window        # (self.window: a sliding one)

    @classmethod
    def of(cls, config, tier_present=None) -> "CompressedTables":
        info = config.model.model_info
        device = BlockManager(config.cache.num_kv_blocks, config.cache.block_size,
                              enable_caching=False)
        return cls(device, info.num_layers * info.num_kv_heads, config.cache.kv_compress_window,
                   config.cache.kv_cache_dtype)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq's table needs for its first num_tokens tokens."""
        state = seq.compress
        if state is None or state.head_lens is None:
            return -(-num_tokens // self.block_size)
        more = num_tokens - state.heads_at
        return blocks_for([n + more for n in state.head_lens], self.block_size)

    def grow(self, seq: Sequence, n: int) -> bool:
        need = self.blocks_needed(seq, seq.num_planned + n) - len(seq.block_ids)
        if need > self.device.num_free:
            return False
        seq.block_ids += self.device.allocate(max(need, 0))
        if seq.compress is None:
            seq.compress = CompressState()
        end = seq.num_planned + n
        seq.compress.next = end >= seq.target_len and not seq.request.prompt_open \
            and end - seq.compress.heads_at >= self.every
        return True

    def step_computed(self, seq: Sequence, compress: CompressResult | None) -> None:
        """A step's result: seq's compression in its compress section, if the step made one
        (before the step's blocks are committed)."""
        if compress is not None and seq.seq_id in compress.head_lens:
            self.compressed(seq, compress.head_lens[seq.seq_id])
        super().step_computed(seq, compress)

    def compressed(self, seq: Sequence, lens: list[int]) -> None:
        """A compression's result: seq's rows hold `lens` tokens; its table keeps the blocks
        they fill (the executor packed them there) and frees the rest."""
        if len(lens) != self.rows:
            raise ValueError(f"{seq.seq_id}: {len(lens)} head rows compressed, not {self.rows}")
        state = seq.compress = seq.compress or CompressState()
        state.head_lens, state.heads_at, state.in_flight = list(lens), seq.num_computed, False
        keep = blocks_for(lens, self.block_size)
        self.device.free(seq.block_ids[keep:][::-1])
        del seq.block_ids[keep:]
        seq.num_blocks_sent = min(seq.num_blocks_sent, keep)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        seq.compress = None

    def swap_out(self, seq: Sequence) -> bool:
        return False            # preempted sequences are recomputed (and compressed again)
