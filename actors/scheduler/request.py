"""The scheduler's record of one sequence, and whether a new request may queue."""
from __future__ import annotations

import enum
import itertools

import msgspec

from pagewire.wire.ids import SeqId, output_ids
from pagewire.wire.kv_transfer import KvTransfer
from pagewire.wire.lora import LoraRef
from pagewire.wire.sampling_params import LogprobsChunk, SamplingParams, stops_on
from pagewire.wire.to_executor import NewSeq, RunSeq
from pagewire.wire.to_scheduler import NewRequest

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted to the host tier: blocks held there, not on the device
    LOADING = "loading"      # waiting for blocks of its prefix from the disk tier
    FINISHED = "finished"


class Request:
    """One sequence, mutated only by the scheduler.

    `num_computed` counts tokens whose K/V are in the cache (their step's result applied);
    `num_in_flight` more are scheduled in plans whose results have not come back, and
    `num_placeholders` of those plans' rows sample a token the executor appends itself (the
    scheduler learns it from the result). Tokens [num_computed + num_in_flight, target_len +
    num_placeholders) are still to plan. (The step engine's ledger is the record of plans in
    flight; `num_in_flight` is this sequence's share of them, kept here because every plan
    needs it for every sequence, where the next plan writes, and because a preemption or an
    abort zeroes it, dropping that work, while the plans stay in the ledger.) A fork leader
    (a prompt that will split into n sequences) targets all but the last prompt token; every
    other request targets all its tokens. `on_executor` says the executor holds this
    request's state; `num_blocks_sent` is how much of the block table
    it holds unchanged. `block_hashes` cover the full blocks of token_ids computed so far
    (prefix caching); the first `num_committed` are committed to the block manager. With a
    sliding window the first `num_dropped` entries of block_ids are no longer this request's
    (freed, maybe reused by others): positions keep their block index, nothing reads them.
    """

    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "sampling", "arrival_time",
                 "max_tokens", "status", "num_computed", "num_scheduled", "block_ids",
                 "num_blocks_sent", "on_executor", "priority", "cache_salt", "order",
                 "block_hashes", "num_committed", "fork_leader", "cum_logprob", "group",
                 "host_block_ids", "new_token_ids", "candidates", "num_prompt_logprobs_sent",
                 "scheduled_before", "prompt_counted", "num_dropped", "num_in_flight",
                 "num_placeholders", "num_drafts", "num_draft_slots", "draft_acceptance",
                 "draft_skips", "lora", "kv_transfer", "prompt_open", "new_prompt_ids",
                 "head_lens", "heads_at", "compress_next", "compressing")

    def __init__(self, seq_id: SeqId, prompt_token_ids: list[int], sampling: SamplingParams,
                 arrival_time: float, max_model_len: int, priority: int = 0,
                 cache_salt: str | None = None, lora: LoraRef | None = None):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.arrival_time = arrival_time
        self.max_tokens = self.room_to_generate(max_model_len)
        self.priority, self.lora = priority, lora
        # Disaggregated prefill/decode: its blocks go under a lease when it ends
        # (remote_decode), or its prefix is pulled from a prefill engine (remote_prefill,
        # cleared once pulled).
        self.kv_transfer: KvTransfer | None = None
        # An adapter's blocks are its own: its content digest salts them (its load id where
        # no digest was taken).
        self.cache_salt = cache_salt if lora is None else \
            f"{cache_salt or ''}\x00lora{lora.digest or lora.id}"
        self.order = next(_arrivals)          # ties in (priority, order) break by arrival
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_scheduled = 0
        self.num_in_flight = 0
        self.num_placeholders = 0
        self.block_ids: list[int] = []
        self.host_block_ids: list[int] = []   # where a swapped-out request's blocks are
        self.num_blocks_sent = 0
        self.on_executor = False
        self.block_hashes: list[bytes] = []
        self.num_committed = 0
        self.fork_leader = False
        self.cum_logprob = 0.0
        self.group = None                     # the BeamGroup a beam belongs to
        self.new_token_ids: list[int] = []    # chosen here, not yet sent to the executor
        self.candidates = None                # a beam's (token ids, logprobs) this step
        self.scheduled_before = False         # admitted once already (metrics: queue time)
        self.prompt_counted = False           # prefill completed once (metrics: prompt tokens)
        self.num_prompt_logprobs_sent = 1     # prompt positions whose logprobs went out
        self.num_dropped = 0                  # leading blocks freed: behind the sliding window
        self.num_drafts = 0                   # draft tokens the executor holds for it
        self.num_draft_slots = 0              # of which the plan in flight verifies
        self.draft_acceptance = 1.0           # moving average of drafts accepted (0..1)
        self.draft_skips = 0                  # steps it did not draft (low acceptance)
        # Streaming input: more prompt comes (PromptPiece); its last known token waits for it,
        # so the step that computes it samples. new_prompt_ids: arrived, not yet sent.
        self.prompt_open = False
        self.new_prompt_ids: list[int] = []
        # KV-Compress (head_tables.py): its head rows' lengths after its latest compression
        # (None: none yet), covering its first heads_at tokens; whether the next plan
        # compresses it, and whether a plan in flight does.
        self.head_lens: list[int] | None = None
        self.heads_at = 0
        self.compress_next = self.compressing = False

    @property
    def key(self) -> tuple[int, int]:
        """Scheduling order: lower runs first, higher is preempted first."""
        return (self.priority, self.order)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def target_len(self) -> int:
        if self.prompt_open:
            return len(self.token_ids) - 1
        return self.num_prompt_tokens - 1 if self.fork_leader else len(self.token_ids)

    @property
    def num_planned(self) -> int:
        """Tokens whose K/V are computed or being computed: where the next plan writes."""
        return self.num_computed + self.num_in_flight

    @property
    def num_pending(self) -> int:
        """Tokens still to plan before the next sample (or fork); 0 when the token an
        in-flight step samples is the last one (max_tokens): nothing to plan ahead of it, or
        while a compression is in flight (its result decides the table)."""
        if self.compressing:
            return 0
        if self.num_placeholders and \
                self.num_output_tokens + self.num_placeholders >= self.max_tokens:
            return 0
        return self.target_len + self.num_placeholders - self.num_planned

    @property
    def samples_when_planned(self) -> bool:
        """Whether its planned tokens reach the end of its tokens, so the executor samples and
        appends the next one (beams are extended here; a fork leader forks instead). Draft
        slots (speculative decoding) are planned past the end: they do not count."""
        return (self.num_planned - self.num_draft_slots == self.target_len + self.num_placeholders
                and not self.fork_leader and self.group is None and not self.prompt_open)

    @property
    def output_ids(self) -> list[SeqId]:
        """The ids the detokenizer and gateway know it by: its own, its beam group's, or a
        fork leader's n outputs."""
        if self.group is not None:
            return self.group.output_ids
        return output_ids(self.seq_id.req, self.sampling.num_outputs) if self.fork_leader \
            else [self.seq_id]

    def fresh_prompt_logprobs(self, chunk: LogprobsChunk) -> LogprobsChunk | None:
        """The part of a step's prompt logprobs not sent before (a recomputed request computes
        them again), marked sent; None if none. Called before num_computed advances: the chunk
        covers prompt tokens num_computed + 1 onward."""
        skip = max(0, self.num_prompt_logprobs_sent - (self.num_computed + 1))
        if skip >= len(chunk.token_ids):
            return None
        self.num_prompt_logprobs_sent = self.num_computed + 1 + len(chunk.token_ids)
        return LogprobsChunk(chunk.token_ids[skip:], chunk.logprobs[skip:],
                             chunk.top_ids[skip:], chunk.top_logprobs[skip:])

    def send_planned(self) -> NewSeq | RunSeq:
        """What a plan carries for this scheduled sequence: all of it the first time (and after
        a preemption), else only the blocks added since; its scheduled tokens are then in
        flight."""
        if self.on_executor:
            offset = self.num_blocks_sent
            entry = RunSeq(self.seq_id, self.num_scheduled, offset, self.block_ids[offset:],
                           self.new_token_ids, self.new_prompt_ids, self.compress_next)
        else:
            self.on_executor = True
            entry = NewSeq(self.seq_id, list(self.token_ids), self.num_prompt_tokens,
                           self.num_computed, self.num_scheduled, list(self.block_ids),
                           self.sampling, self.lora, self.compress_next)
        self.num_blocks_sent, self.new_token_ids, self.new_prompt_ids = len(self.block_ids), [], []
        self.compressing, self.compress_next = self.compress_next, False
        self.num_in_flight += self.num_scheduled
        self.num_placeholders += self.samples_when_planned
        return entry

    def extend_prompt(self, tokens: list[int], last: bool, max_model_len: int) -> None:
        """A piece of its open prompt arrived (streaming input)."""
        self.token_ids += tokens
        self.num_prompt_tokens += len(tokens)
        if self.on_executor:
            self.new_prompt_ids += tokens
        self.max_tokens = self.room_to_generate(max_model_len)
        self.prompt_open = not last

    def room_to_generate(self, max_model_len: int) -> int:
        """Tokens it may generate: max_tokens, within what the context leaves after the
        prompt."""
        room = max_model_len - self.num_prompt_tokens
        limit = self.sampling.max_tokens
        return room if limit is None else min(limit, room)

    def reset_in_flight(self) -> None:
        """Forget the steps in flight (preempted or ended: their results are ignored)."""
        self.num_in_flight = self.num_placeholders = self.num_draft_slots = 0

    def stop_reason(self, token: int, eos_ids: frozenset[int]) -> str | None:
        """Why the sequence ends with `token` (just appended): "stop", "length" or None."""
        if stops_on(self.sampling, token, self.num_output_tokens, eos_ids):
            return "stop"
        if self.num_output_tokens >= self.max_tokens:
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
    # so a new list slot cannot end up shared between two sequences by accident.
    SHARED = ("num_prompt_tokens", "arrival_time", "max_tokens", "status", "num_computed",
              "priority", "cache_salt", "order", "num_committed", "cum_logprob", "group",
              "scheduled_before", "prompt_counted", "num_prompt_logprobs_sent", "num_dropped",
              "lora", "kv_transfer", "prompt_open")
    COPIED = ("token_ids", "block_ids", "block_hashes", "new_token_ids",
              "new_prompt_ids")                                             # lists, copied
    FRESH = ("seq_id", "sampling", "fork_leader", "host_block_ids", "candidates",
             "on_executor", "num_blocks_sent", "num_scheduled", "num_in_flight",
             "num_drafts", "num_draft_slots", "draft_acceptance", "draft_skips",
             "num_placeholders", "head_lens", "heads_at", "compress_next", "compressing")
    # (the fork's own: forks happen with nothing in flight, and never under KV-Compress)

    def output_forks(self) -> list["Request"]:
        """A computed prompt's sequences (n, or best_of to choose from), each with its own
        seed (seed + j: seeded outputs are reproducible one by one)."""
        s, forks = self.sampling, []
        for j, child_id in enumerate(output_ids(self.seq_id.req, s.num_sequences)):
            seed = None if s.seed is None else (s.seed + j) % 2**63
            logprobs = s.logprobs if s.best_of is None else max(s.logprobs or 0, 0)
            forks.append(self.fork(child_id, msgspec.structs.replace(
                s, n=1, best_of=None, seed=seed, logprobs=logprobs)))
        return forks

    def fork(self, seq_id: SeqId, sampling: SamplingParams) -> "Request":
        """A sequence with this one's tokens and blocks (the caller takes block references)."""
        child = Request.__new__(Request)
        for name in self.SHARED:                 # immutable values, or the shared beam group
            setattr(child, name, getattr(self, name))
        for name in self.COPIED:
            setattr(child, name, list(getattr(self, name)))
        child.seq_id, child.sampling, child.fork_leader = seq_id, sampling, False
        child.host_block_ids, child.candidates, child.on_executor = [], None, False
        child.num_blocks_sent = child.num_scheduled = 0
        child.num_in_flight = child.num_placeholders = 0
        child.head_lens, child.heads_at, child.compress_next, child.compressing = \
            None, 0, False, False
        child.num_drafts = child.num_draft_slots = child.draft_skips = 0
        child.draft_acceptance = 1.0
        return child


def queue_refusal(msg: NewRequest, config,
                  waiting: list[Request]) -> tuple[str, str] | None:
    """(finish reason, error) for a request that can never run or finds the queue full;
    `config`: the EngineConfig (max_model_len and the queue limits)."""
    limit = config.max_model_len
    if len(msg.prompt_token_ids) >= limit:
        return "error", (f"prompt of {len(msg.prompt_token_ids)} tokens does not fit "
                         f"max_model_len={limit}")
    max_reqs, max_tokens = config.max_num_queued_reqs, config.max_num_queued_tokens
    if max_reqs is not None and len(waiting) >= max_reqs:
        return "rejected", f"the queue is full ({max_reqs} requests waiting)"
    if max_tokens is not None:
        queued = sum(r.num_pending for r in waiting) + len(msg.prompt_token_ids)
        if queued > max_tokens:
            return "rejected", f"the queue is full (over {max_tokens} prompt tokens waiting)"
    return None
