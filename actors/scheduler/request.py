"""The scheduler's records of a request and of its sequences."""
from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import msgspec

from pagewire.wire.ids import SeqId, output_ids
from pagewire.wire.kv_transfer import KvTransfer
from pagewire.wire.lora import LoraRef
from pagewire.wire.multimodal import ImageInput
from pagewire.wire.pooling import PoolingSeq
from pagewire.wire.sampling_params import LogprobsChunk, SamplingParams, stops_on
from pagewire.wire.to_detokenizer import TokenDelta
from pagewire.wire.to_executor import NewSeq, RunSeq
from pagewire.wire.to_scheduler import PromptLogprobsResult

if TYPE_CHECKING:        # the feature records, defined beside each feature's scheduler module
    from .beam import BeamGroup
    from .head_tables import CompressState
    from .prompt_stream import StreamState
    from .speculation import DraftState

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted to the host tier: blocks held there, not on the device
    LOADING = "loading"      # waiting for blocks of its prefix from the disk tier
    FINISHED = "finished"


class Request:
    """One request as admitted, mutated only by the scheduler: what its sequences share.

    A plain request has one sequence; n / best_of give it a fork leader (its prompt) that
    splits into n sequences once computed, and beam search a BeamGroup whose beams are its
    sequences; `seqs` are those live now. The prompt's tokens are the first
    `num_prompt_tokens` of each sequence's token_ids (streaming input grows it while only one
    sequence exists). Feature state sits in records that exist only where the feature is used:
    `transfer` (disaggregated prefill/decode, the NewRequest's KvTransfer: its blocks go under
    a lease when it ends (remote_decode), or its prefix is pulled from a prefill engine
    (remote_prefill), cleared once pulled), `stream` (streaming input, prompt_stream.py),
    `group` (beam search, beam.py), `images` (the prompt's images: their digests enter the
    block hashes, and every NewSeq carries them to the executors), `pooling` (a prompt read,
    not continued: its sequence ends with the pooled output once computed; every NewSeq
    carries it).
    """

    __slots__ = ("req_id", "sampling", "arrival_time", "priority", "cache_salt", "lora",
                 "order", "num_prompt_tokens", "max_tokens", "scheduled_before",
                 "prompt_counted", "num_prompt_logprobs_sent", "seqs", "group", "transfer",
                 "stream", "images", "pooling")

    def __init__(self, req_id: str, num_prompt_tokens: int, sampling: SamplingParams,
                 arrival_time: float, max_model_len: int, priority: int = 0,
                 cache_salt: str | None = None, lora: LoraRef | None = None):
        self.req_id, self.sampling, self.arrival_time = req_id, sampling, arrival_time
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = self.room_to_generate(max_model_len)
        self.priority, self.lora = priority, lora
        # An adapter's blocks are its own: its content digest salts them (its load id where
        # no digest was taken).
        self.cache_salt = cache_salt if lora is None else \
            f"{cache_salt or ''}\x00lora{lora.digest or lora.id}"
        self.order = next(_arrivals)          # ties in (priority, order) break by arrival
        self.scheduled_before = False         # admitted once already (metrics: queue time)
        self.prompt_counted = False           # prefill completed once (metrics: prompt tokens)
        self.num_prompt_logprobs_sent = 1     # prompt positions whose logprobs went out
        self.seqs: list[Sequence] = []
        self.group: BeamGroup | None = None
        self.transfer: KvTransfer | None = None
        self.stream: StreamState | None = None
        self.images: list[ImageInput] | None = None   # its prompt's (wire/multimodal.py)
        self.pooling: PoolingSeq | None = None  # pooled once computed (wire/pooling.py)

    @property
    def key(self) -> tuple[int, int]:
        """Scheduling order: lower runs first, higher is preempted first."""
        return (self.priority, self.order)

    @property
    def prompt_open(self) -> bool:
        """More of the prompt is still to come (streaming input)."""
        return self.stream is not None and self.stream.open

    def room_to_generate(self, max_model_len: int) -> int:
        """Tokens it may generate: max_tokens, within what the context leaves after the
        prompt."""
        room = max_model_len - self.num_prompt_tokens
        limit = self.sampling.max_tokens
        return room if limit is None else min(limit, room)

    def prompt_logprob_deltas(self, seq: Sequence,
                              section: PromptLogprobsResult | None) -> list[TokenDelta]:
        """What a step's prompt_logprobs section holds for seq (before the step counts as
        computed) and was not sent before: one delta per output sequence, or none."""
        chunk = section.chunks.get(seq.seq_id) if section is not None else None
        fresh = self.fresh_prompt_logprobs(chunk, seq.num_computed) if chunk is not None else None
        return [] if fresh is None else [TokenDelta(i, [], prompt_logprobs=fresh)
                                         for i in seq.output_ids]

    def fresh_prompt_logprobs(self, chunk: LogprobsChunk,
                              num_computed: int) -> LogprobsChunk | None:
        """The part of a step's prompt logprobs not sent before (a recomputed sequence computes
        them again), marked sent; None if none. `num_computed`: the sequence's, before this
        step's: the chunk covers prompt tokens num_computed + 1 onward."""
        skip = max(0, self.num_prompt_logprobs_sent - (num_computed + 1))
        if skip >= len(chunk.token_ids):
            return None
        self.num_prompt_logprobs_sent = num_computed + 1 + len(chunk.token_ids)
        return LogprobsChunk(chunk.token_ids[skip:], chunk.logprobs[skip:],
                             chunk.top_ids[skip:], chunk.top_logprobs[skip:])


class Sequence:
    """One sequence of a request (its only one, a fork leader or fork, or a beam), mutated
    only by the scheduler: its tokens, blocks, status and counters.

    `num_computed` counts tokens whose K/V are in the cache (their step's result applied);
    `num_in_flight` more are scheduled in plans whose results have not come back, and
    `num_placeholders` of those plans' rows sample a token the executor appends itself (the
    scheduler learns it from the result). Tokens [num_computed + num_in_flight, target_len +
    num_placeholders) are still to plan. (The step engine's ledger is the record of plans in
    flight; `num_in_flight` is this sequence's share of them, kept here because every plan
    needs it for every sequence, where the next plan writes, and because a preemption or an
    abort zeroes it, dropping that work, while the plans stay in the ledger.) A fork leader
    (a prompt that will split into n sequences) targets all but the last prompt token; every
    other sequence targets all its tokens. `on_executor` says the executor holds this
    sequence's state; `num_blocks_sent` is how much of the block table
    it holds unchanged. `block_hashes` cover the full blocks of token_ids computed so far
    (prefix caching); the first `num_committed` are committed to the block manager. With a
    sliding window the first `num_dropped` entries of block_ids are no longer this sequence's
    (freed, maybe reused by others): positions keep their block index, nothing reads them.
    `sampling` is the request's, or a fork's own (n=1, its seed). Feature state, None where
    the feature is not in use: `spec` (speculative decoding, speculation.py) and `compress`
    (KV-Compress, head_tables.py).
    """

    __slots__ = ("seq_id", "request", "sampling", "token_ids", "status", "num_computed",
                 "num_scheduled", "num_in_flight", "num_placeholders", "block_ids",
                 "num_blocks_sent", "on_executor", "block_hashes", "num_committed",
                 "num_dropped", "host_block_ids", "fork_leader", "cum_logprob",
                 "new_token_ids", "spec", "compress")

    def __init__(self, seq_id: SeqId, request: Request, token_ids: list[int],
                 sampling: SamplingParams | None = None):
        self.seq_id, self.request = seq_id, request
        self.sampling = request.sampling if sampling is None else sampling
        self.token_ids = token_ids
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_scheduled = 0
        self.num_in_flight = 0
        self.num_placeholders = 0
        self.block_ids: list[int] = []
        self.num_blocks_sent = 0
        self.on_executor = False
        self.block_hashes: list[bytes] = []
        self.num_committed = 0
        self.num_dropped = 0                  # leading blocks freed: behind the sliding window
        self.host_block_ids: list[int] = []   # where a swapped-out sequence's blocks are
        self.fork_leader = False
        self.cum_logprob = 0.0
        self.new_token_ids: list[int] = []    # chosen here, not yet sent to the executor
        self.spec: DraftState | None = None
        self.compress: CompressState | None = None

    # The request's, read through: its sequences queue, count and stop alike.
    @property
    def key(self) -> tuple[int, int]:
        return self.request.key

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def computes_every_position(self) -> bool:
        """Whether every prompt position must be computed here, none mapped from the prefix
        cache: its prompt logprobs, or a per-token pooled output (wire/pooling.py)."""
        pooling = self.request.pooling
        return self.sampling.prompt_logprobs is not None or (pooling is not None and
                                                             pooling.per_token)

    @property
    def num_draft_slots(self) -> int:
        """Of the positions the plan in flight runs, how many verify drafts."""
        return 0 if self.spec is None else self.spec.num_slots

    @property
    def target_len(self) -> int:
        if self.request.prompt_open:
            return len(self.token_ids) - 1
        return self.request.num_prompt_tokens - 1 if self.fork_leader else len(self.token_ids)

    @property
    def num_planned(self) -> int:
        """Tokens whose K/V are computed or being computed: where the next plan writes."""
        return self.num_computed + self.num_in_flight

    @property
    def num_pending(self) -> int:
        """Tokens still to plan before the next sample (or fork); 0 when the token an
        in-flight step samples is the last one (max_tokens): nothing to plan ahead of it, or
        while a compression is in flight (its result decides the table)."""
        if self.compress is not None and self.compress.in_flight:
            return 0
        if self.num_placeholders and \
                self.num_output_tokens + self.num_placeholders >= self.request.max_tokens:
            return 0
        return self.target_len + self.num_placeholders - self.num_planned

    @property
    def samples_when_planned(self) -> bool:
        """Whether its planned tokens reach the end of its tokens, so the executor samples and
        appends the next one (beams are extended here; a fork leader forks instead). Draft
        slots (speculative decoding) are planned past the end: they do not count."""
        return (self.num_planned - self.num_draft_slots == self.target_len + self.num_placeholders
                and not self.fork_leader and self.request.group is None
                and not self.request.prompt_open)

    @property
    def output_ids(self) -> list[SeqId]:
        """The ids the detokenizer and gateway know it by: its own, its beam group's, or a
        fork leader's n outputs."""
        req = self.request
        if req.group is not None:
            return req.group.output_ids
        return output_ids(req.req_id, self.sampling.num_outputs) if self.fork_leader \
            else [self.seq_id]

    def send_planned(self) -> NewSeq | RunSeq:
        """What a plan carries for this scheduled sequence: all of it the first time (and after
        a preemption), else only the blocks added since; its scheduled tokens are then in
        flight."""
        compress = self.compress is not None and self.compress.next
        stream = self.request.stream
        if self.on_executor:
            offset = self.num_blocks_sent
            new_prompt = stream.not_sent if stream is not None else []
            entry = RunSeq(self.seq_id, self.num_scheduled, offset, self.block_ids[offset:],
                           self.new_token_ids, new_prompt, compress)
        else:
            self.on_executor = True
            entry = NewSeq(self.seq_id, list(self.token_ids), self.request.num_prompt_tokens,
                           self.num_computed, self.num_scheduled, list(self.block_ids),
                           self.sampling, self.request.lora, compress,
                           self.request.images or [], self.request.pooling)
        self.num_blocks_sent, self.new_token_ids = len(self.block_ids), []
        if stream is not None:
            stream.not_sent = []
        if self.compress is not None:
            self.compress.in_flight, self.compress.next = self.compress.next, False
        self.num_in_flight += self.num_scheduled
        self.num_placeholders += self.samples_when_planned
        return entry

    def reset_in_flight(self) -> None:
        """Forget the steps in flight (preempted or ended: their results are ignored)."""
        self.num_in_flight = self.num_placeholders = 0
        if self.spec is not None:
            self.spec.num_slots = 0

    def dropped_from_executor(self) -> None:
        """The executor forgot this sequence's state: what it was to learn next goes with it
        (a NewSeq carries everything again), and so do its drafts."""
        self.on_executor = False
        self.new_token_ids = []
        if self.spec is not None:
            self.spec.num_drafts = 0
        if self.request.stream is not None:
            self.request.stream.not_sent = []

    def stop_reason(self, token: int, eos_ids: frozenset[int]) -> str | None:
        """Why the sequence ends with `token` (just appended): "stop", "length" or None."""
        if stops_on(self.sampling, token, self.num_output_tokens, eos_ids):
            return "stop"
        if self.num_output_tokens >= self.request.max_tokens:
            return "length"
        return None

    def append_verified(self, tokens: list[int], eos_ids: frozenset[int]) -> tuple[list[int],
                                                                                   str | None]:
        """Append a step's tokens (its sample, or the drafts it verified and the next) up to
        the first that ends the sequence: (those appended, why it ended or None). A token after
        the first follows an accepted draft, whose position is now computed."""
        appended, reason = [], None
        for i, token in enumerate(tokens):
            if i:                  # the token before it was an accepted draft: computed
                self.num_computed += 1
            self.token_ids.append(token)
            appended.append(token)
            reason = self.stop_reason(token, eos_ids)
            if reason:
                break
        return appended, reason

    # What a fork takes from its parent: every slot is named in exactly one of these (tested),
    # so a new list slot cannot end up shared between two sequences by accident. What the
    # request holds (prompt, sampling, priority, salt, adapter, arrival, feature records of
    # the request) is not copied: the fork references the same Request.
    SHARED = ("request", "status", "num_computed", "num_committed", "num_dropped",
              "cum_logprob")
    COPIED = ("token_ids", "block_ids", "block_hashes", "new_token_ids")   # lists, copied
    FRESH = ("seq_id", "sampling", "fork_leader", "host_block_ids",
             "on_executor", "num_blocks_sent", "num_scheduled", "num_in_flight",
             "num_placeholders", "spec", "compress")
    # (the fork's own: forks happen with nothing in flight, and never under KV-Compress)

    def output_forks(self) -> list["Sequence"]:
        """A computed prompt's sequences (n, or best_of to choose from), each with its own
        seed (seed + j: seeded outputs are reproducible one by one)."""
        s, forks = self.sampling, []
        for j, child_id in enumerate(output_ids(self.request.req_id, s.num_sequences)):
            seed = None if s.seed is None else (s.seed + j) % 2**63
            logprobs = s.logprobs if s.best_of is None else max(s.logprobs or 0, 0)
            forks.append(self.fork(child_id, msgspec.structs.replace(
                s, n=1, best_of=None, seed=seed, logprobs=logprobs)))
        return forks

    def fork(self, seq_id: SeqId, sampling: SamplingParams) -> "Sequence":
        """A sequence of the same request with this one's tokens and blocks (the caller takes
        block references, and adds it to the request's seqs when it adopts it)."""
        child = Sequence(seq_id, self.request, list(self.token_ids), sampling)
        child.status, child.num_computed = self.status, self.num_computed
        child.num_committed, child.num_dropped = self.num_committed, self.num_dropped
        child.cum_logprob = self.cum_logprob
        child.block_ids, child.block_hashes = list(self.block_ids), list(self.block_hashes)
        child.new_token_ids = list(self.new_token_ids)
        return child
