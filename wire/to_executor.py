"""Messages an executor receives: one StepPlan per step from the scheduler (rank 0), which
rank 0 forwards to the other tensor-parallel ranks; and the attach handshake between ranks.

A request's full data (tokens, sampling) crosses once, in a NewSeq; while it keeps running the
plan carries only a RunSeq: how many tokens to compute and the blocks added since last step.
The executor appends the token it samples to its own copy of the request's tokens, so the
scheduler never resends tokens. A request that was preempted comes back as a NewSeq.
"""
from __future__ import annotations

import msgspec

from .engine_control import SleepEngine, UpdateWeights, WakeEngine
from .ids import SeqId
from .kv_transfer import KvLease, KvSource
from .lora import LoraRef
from .multimodal import ImageInput
from .pooling import PoolingSeq
from .sampling_params import SamplingParams


class NewSeq(msgspec.Struct, array_like=True, gc=False):
    seq_id: SeqId
    token_ids: list[int]        # prompt, plus outputs when resuming after preemption
    num_prompt_tokens: int
    num_computed: int           # tokens whose K/V are already in the cache (prefix hits)
    num_scheduled: int          # tokens to compute this step
    block_ids: list[int]        # the whole block table so far
    sampling: SamplingParams
    lora: LoraRef | None = None     # its adapter; None: the base model
    compress: bool = False      # KV-Compress: evict after this step (executor/head_blocks.py)
    images: list[ImageInput] = []   # the prompt's images (multimodal.py), sent with it each time
    pooling: PoolingSeq | None = None   # pooled once computed, never sampled (pooling.py)


class RunSeq(msgspec.Struct, array_like=True, gc=False):
    seq_id: SeqId
    num_scheduled: int
    block_offset: int           # the block table from this index on is replaced by block_ids
    block_ids: list[int]        # (new blocks, and a block swapped in by copy-on-write)
    new_token_ids: list[int] = []   # tokens the scheduler chose (beam search) to append first
    new_prompt_ids: list[int] = []  # prompt tokens that arrived since (streaming input), before
    compress: bool = False          # KV-Compress: evict after this step


class KvLoad(msgspec.Struct, array_like=True, gc=False):
    """Blocks of one waiting sequence to fill, in table order: from the disk tier, or pulled
    from a prefill engine (`source`, kv_transfer.py)."""
    seq_id: SeqId
    block_ids: list[int]
    hashes: list[bytes]
    source: KvSource | None = None


class TierWork(msgspec.Struct, array_like=True, gc=False):
    """The disk KV tier's part of a step, in this order: store the content of `store_ids`
    (committed blocks: no step changes their bytes again) under `store_hashes`, fill the
    `loads`' blocks, delete the files of `drops` (beyond the tier's size)."""
    store_ids: list[int] = []
    store_hashes: list[bytes] = []
    loads: list[KvLoad] = []
    drops: list[bytes] = []


class StepPlan(msgspec.Struct, tag=True, gc=False):
    """Invariant: a sequence appears at most once in new + running. Before the step runs the
    executor drops the state of the `finished` ids (ended: done or aborted) and of the
    `preempted` ones (they come back later as a NewSeq), does the `tier` work and the `pulls`
    (before any block is written), then copies blocks: `swap_out` [device, host] pairs, then `swap_in`
    [host, device], then `copies` [src, dst] device pairs (copy-on-write)."""
    step_id: int
    new: list[NewSeq]
    running: list[RunSeq]
    finished: list[SeqId]
    copies: list[list[int]] = []
    swap_out: list[list[int]] = []
    swap_in: list[list[int]] = []
    preempted: list[SeqId] = []
    tier: TierWork | None = None
    leases: list[KvLease] = []      # blocks the KV server may now serve (kv_transfer.py)
    pulls: list[KvLoad] = []        # blocks to pull from prefill engines, with the tier's


# Sleep mode's controls (engine_control.py) come in the place of a plan, in plan order.
ExecutorInbox = StepPlan | SleepEngine | WakeEngine | UpdateWeights


# -- between tensor-parallel ranks -------------------------------------------------------------
# An executor of rank r > 0 connects to rank 0's rank socket (ipc for ranks the engine starts,
# tcp with CURVE keys for attached ones) and says AttachHello; rank 0 checks it and answers
# AttachWelcome or AttachRefused. Then rank 0 forwards every StepPlan, and both sides send
# RankPing each second: a rank that hears nothing for a while takes its peer for gone.

class AttachHello(msgspec.Struct, tag=True, kw_only=True):
    version: str                 # pagewire.__version__ of the executor
    rank: int
    tensor_parallel_size: int
    model_name: str
    model_digest: str            # of the weights the executor found locally
    dtype: str | None = None     # when the executor was told one: it must match


class AttachWelcome(msgspec.Struct, tag=True):
    config_json: str             # the engine's resolved configuration, API keys removed
    dist_address: str            # tcp://HOST:PORT of the torch.distributed store


class AttachRefused(msgspec.Struct, tag=True):
    reason: str


class RankPing(msgspec.Struct, tag=True):
    rank: int


RankZeroInbox = AttachHello | RankPing
RankInbox = (StepPlan | SleepEngine | WakeEngine | UpdateWeights | AttachWelcome | AttachRefused
             | RankPing)
