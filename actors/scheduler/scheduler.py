"""The scheduler: the only owner of request state and of the KV block tables.

Its records: a Request and the Sequences it owns (request.py; n / best_of forks and beams are
sequences of one request), feature state in records beside each feature's module (drafts in
speculation.py, compression in head_tables.py, a streamed prompt in prompt_stream.py), and
the index of live ones with a new request's admission (live_requests.py).

Each step, schedule() picks which tokens of which sequences run under one token budget shared
by decodes and prefill chunks (no separate phases): running sequences first, in (priority,
arrival) order, then waiting ones, admitted by the admission policy (admission.py: cached
prefixes, prefix wait, adapters, priority). A request prefilled for a remote decode leaves its
full blocks under a lease when it ends, until the KV server says it ended.
When blocks run out, the last running sequence in that order is preempted: its blocks swapped
to the host tier or freed for a recompute (admission.py give_way). update() applies a
StepResult: appends sampled tokens, forks prompts into their n sequences, advances beams,
finishes sequences (EOS, stop ids, max_tokens, context full) and frees their blocks.

Metrics are plain counters here (no clocks, no I/O; the actor times and reports them):
num_prompt_tokens (a prompt's length, counted once when its prefill first completes, cached
tokens included, as vLLM counts), num_generation_tokens (tokens sampled), num_preemptions,
tables.prefix_queries / prefix_hits, and first_scheduled (the arrival times of the requests the
latest schedule() ran for the first time).

Each schedule() is answered by one update(plan, rows, result), in plan order, where `rows` are
what schedule() returned beside the plan (the step engine keeps both in its ledger of plans in
flight, engine.py: the scheduler holds no record of plans of its own). A plan may be made
before the previous one's result is applied (pipelined steps): it then assumes that
every running sequence whose planned tokens reach its end gets one more token (a placeholder
the executor fills in itself, since it runs plans in order), and plans nothing past a token
that ends the sequence by max_tokens. add() and abort() may come at any time; update() skips
sequences that ended or were preempted meanwhile (their in-flight work is dropped).
"""
from __future__ import annotations

from pagewire.model_info import WHOLE_IMAGE_ARCHITECTURES
from pagewire.wire.ids import SeqId
from pagewire.wire.to_detokenizer import TokenDelta
from pagewire.wire.kv_transfer import KvLeaseEnded, KvPulled
from pagewire.wire.to_executor import NewSeq, StepPlan
from pagewire.wire.to_scheduler import EncoderResult, NewRequest, PromptPiece, StepResult

from ..config import EngineConfig
from .admission import AdmissionPolicy
from .arrivals import Arrivals
from .beam import BeamGroup
from .block_tables import BlockTables
from .encoder_budget import EncoderBudget
from .head_tables import CompressedTables
from .live_requests import LiveRequests
from .prefix_wait import PrefixWait
from .prompt_stream import extend_prompt
from .request import Sequence, Status
from .speculation import DraftPolicy

# A plan's sequences with the tokens each was scheduled for: what update() needs of the plan
# besides the StepPlan. Kept by the step engine's ledger until the plan's result comes.
StepRows = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, config: EngineConfig, tier_present: list[bytes] | None = None):
        """tier_present: the block hashes the disk tier held at start (kv_tier_files.scan)."""
        self.config = config
        tables = BlockTables if config.cache.kv_compress_rate is None else CompressedTables
        self.tables = tables.of(config, tier_present)
        self.kv = self.tables.device
        self.eos_ids = frozenset(config.model.model_info.eos_token_ids)
        # image tokens that attend their whole image: a chunk never splits one
        self.whole_images = config.model.model_info.architecture in WHOLE_IMAGE_ARCHITECTURES
        self.live = LiveRequests()               # live_requests.py; its tables by name here
        # (the same objects, only ever changed in place)
        self.requests, self.seqs, self.groups = self.live.requests, self.live.seqs, self.live.groups
        self.waiting, self.running = self.live.waiting, self.live.running
        self.arrivals = Arrivals(self.tables)   # waiting for blocks (tier, prefill engine)
        # waiting for blocks a running sequence is computing (prefix_wait.py)
        self.prefix_wait = PrefixWait(self.tables, config.scheduler.prefix_wait)
        self.admission = AdmissionPolicy(config, self.live, self.tables, self.arrivals,
                                         self.prefix_wait)
        # Sequences whose executor state the next plan drops: ended ones (plan.finished) and
        # preempted ones (plan.preempted).
        self.to_drop: list[SeqId] = []
        self.preempted_ids: list[SeqId] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0               # metrics counters; see the module docstring
        self.num_generation_tokens = 0
        self.num_experts_read = 0                # mixtures of experts: expert reads, and the
        self.num_moe_steps = 0                   # steps that read any
        self.encoder = EncoderResult(0, 0, 0.0)  # vision: the encoder's totals
        self.drafts = DraftPolicy(config.speculative_config)   # speculation.py; its counters
        self.first_scheduled: list[float] = []   # arrival times, reset by each schedule()

    def has_work(self) -> bool:
        """Something to plan: sequences, or work a plan carries alone: blocks to store in the
        disk tier (a finished request's last ones), leases to hand to the KV server."""
        tier = self.tables.tier
        return bool(self.waiting or self.running or self.tables.new_leases
                    or tier is not None and tier.has_work())

    def kv_cache_usage(self) -> float:
        """Fraction of device KV blocks held by sequences (free cached blocks count as free)."""
        return 1.0 - self.kv.num_free / self.kv.num_blocks if self.kv.num_blocks else 0.0

    # -- arrivals and aborts ---------------------------------------------------------------

    def add(self, msg: NewRequest) -> list[TokenDelta]:
        """Queue a request. Returns final deltas at once if it can never run or is refused."""
        seq, refused = self.live.open(msg, self.config, self.admission.by_priority)
        if seq is None:
            return refused
        if seq.fork_leader and seq.num_pending == 0:   # a one-token prompt: fork right away
            self._count_prompt(seq)
            self._fork(seq)                            # (_finish takes it out of waiting)
        return []

    def extend(self, msg: PromptPiece) -> list[TokenDelta]:
        """More of an open prompt (streaming input). Ignored once the request has ended."""
        seq = self.seqs.get(SeqId(msg.req_id))
        if seq is None or not seq.request.prompt_open:
            return []
        if len(seq.token_ids) + len(msg.token_ids) >= self.config.model.max_model_len:
            return self._fail(seq, f"the streamed prompt grew past max_model_len="
                                   f"{self.config.model.max_model_len}")
        extend_prompt(seq, msg.token_ids, msg.last, self.config.model.max_model_len)
        return []

    def abort(self, seq_ids: list[SeqId]) -> list[TokenDelta]:
        """End these output sequences (a beam search's or an unforked prompt's whole request,
        by any of its output ids). Every id gets a final "abort" delta, known or not, so the
        detokenizer can forget it."""
        for sid in seq_ids:
            for seq in self.live.ended_by_abort(sid):
                self._finish(seq)
        return [TokenDelta(sid, [], "abort") for sid in seq_ids]

    def abort_all(self) -> list[TokenDelta]:
        """End every request, by the output ids the detokenizer and gateway know."""
        return self.abort(self.live.output_ids())

    # -- planning ----------------------------------------------------------------------------

    def schedule(self, steps_in_flight: int = 0) -> tuple[StepPlan, StepRows] | None:
        """Decide the next step, given how many plans are in flight (their results not yet
        applied): the plan and its rows (for update()), or None when there is nothing to run."""
        budget = self.config.scheduler.max_num_batched_tokens
        self.encoder_rows = EncoderBudget(self.config.scheduler.encoder_budget or budget,
                                          self.whole_images)
        self.first_scheduled = []
        while (victim := self.admission.priority_victim()) is not None:
            self._preempt(victim)
        scheduled, budget, preempted = self._schedule_running(budget)
        if not preempted:   # blocks ran short for running work: admit nothing new this step
            step = (budget, self.encoder_rows, self.first_scheduled)
            scheduled += self.admission.admit(*step)
            if not scheduled and not steps_in_flight and self.prefix_wait.release_all():
                scheduled += self.admission.admit(*step)
            if not scheduled and not steps_in_flight and self.admission.release_waiting_blocks():
                scheduled += self.admission.admit(*step)
        tier = self.tables.tier.take_work() if self.tables.tier is not None else None
        pulls, leases = self.tables.take_pulls(), self.tables.take_leases()
        self.arrivals.planned(pulls)
        if not (scheduled or tier or pulls or leases):
            return None
        self.step_id += 1
        rows = [(seq, seq.num_scheduled) for seq in scheduled]
        copies, swap_out, swap_in = self.tables.take_copies()
        plan = StepPlan(self.step_id, [], [], self.to_drop, copies, swap_out, swap_in,
                        self.preempted_ids, tier, leases, pulls)
        self.to_drop, self.preempted_ids = [], []
        for seq in scheduled:
            entry = seq.send_planned()
            (plan.new if isinstance(entry, NewSeq) else plan.running).append(entry)
        return plan, rows

    def _schedule_running(self, budget: int) -> tuple[list[Sequence], int, bool]:
        scheduled, preempted, i = [], False, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self.encoder_rows.cut(seq, min(seq.num_pending, budget))
            k = self.drafts.grant(seq, budget - 1, len(self.running)) if n == 1 else 0
            grown = n > 0 and self.tables.grow(seq, n + k)
            if not grown and k:        # no room for the drafts' slots: a plain decode
                k, grown = 0, self.tables.grow(seq, n)
            if n == 0:                 # a beam waiting for its siblings' candidates
                i += 1
            elif grown:
                seq.num_scheduled = n + k
                if seq.spec is not None:
                    seq.spec.num_slots = k
                scheduled.append(seq)
                budget -= n + k
                i += 1
            else:
                # Out of blocks: preempt from the back (lowest priority, latest arrival; never
                # one already scheduled this step) until seq fits or is preempted itself.
                self._preempt(self.running[-1])
                preempted = True
        return scheduled, budget, preempted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_from_executor(seq, preempted=True)
        seq.status = self.admission.give_way(seq)
        self.live.enqueue(seq)
        self.num_preemptions += 1

    def _drop_from_executor(self, seq: Sequence, preempted: bool = False) -> None:
        """The executor forgets seq with the next plan; its steps in flight are ignored."""
        seq.reset_in_flight()
        if seq.on_executor:
            (self.preempted_ids if preempted else self.to_drop).append(seq.seq_id)
            seq.dropped_from_executor()

    def _finish(self, seq: Sequence, lease: bool = False) -> None:
        """Remove a sequence wherever it is and free its blocks (or, `lease`, hold them for a
        decode engine to pull: kv_transfer.py)."""
        if seq.status is Status.LOADING:
            self.arrivals.abandon(seq)
        self.live.dequeue(seq)
        self.prefix_wait.forget(seq)
        if lease:
            self.tables.lease(seq)
        self.tables.release(seq)
        self._drop_from_executor(seq)
        seq.status = Status.FINISHED
        self.live.forget(seq)

    # -- results -----------------------------------------------------------------------------

    def update(self, plan: StepPlan, scheduled: StepRows,
               result: StepResult) -> list[TokenDelta]:
        """Apply the executor's result for `plan` (with the rows schedule() returned for it);
        returns the token deltas."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        for seq in self.arrivals.tier_loaded(plan, result.tier, result.error is not None):
            self._back_in_line(seq)
        if result.error is not None:
            return self._fail_step(scheduled, result.error)
        if result.experts_read:
            self.num_experts_read += result.experts_read
            self.num_moe_steps += 1
        if result.encoder is not None:
            e = result.encoder
            self.encoder = EncoderResult(self.encoder.queries + e.queries,
                                         self.encoder.hits + e.hits,
                                         self.encoder.seconds + e.seconds)
        rows = {sid: i for i, sid in enumerate(result.seq_ids)}
        deltas, groups = [], []
        # A sequence preempted while in this step is RUNNING again only from a plan made after
        # this result (at most two plans are in flight): the status check tells them apart.
        for seq, n in scheduled:
            if seq.status is not Status.RUNNING:   # ended or preempted meanwhile
                continue
            deltas += seq.request.prompt_logprob_deltas(seq, result.prompt_logprobs)
            seq.num_in_flight -= n
            seq.num_computed += n - seq.num_draft_slots    # drafts count once accepted
            self.tables.step_computed(seq, result.compress)
            reached_end = seq.num_computed == seq.target_len
            if not seq.request.prompt_counted and reached_end and not seq.request.prompt_open:
                self._count_prompt(seq)
            if seq.request.pooling is not None:
                if reached_end:
                    deltas.append(self._pooled(seq, result))
                continue
            row = rows.get(seq.seq_id)
            if seq.fork_leader:
                if reached_end:
                    self._fork(seq)
            elif row is not None and seq.request.group is not None:
                seq.request.group.offer(seq, result.logprobs, row)
                if seq.request.group not in groups:
                    groups.append(seq.request.group)
            elif row is not None and result.errors and seq.seq_id in result.errors:
                self._finish(seq)
                deltas.append(TokenDelta(seq.seq_id, [], "error", result.errors[seq.seq_id]))
            elif row is not None:
                seq.num_placeholders -= 1
                deltas.append(self._append(seq, result, row))
        for group in groups:
            if group.ready():
                deltas += self._advance_beams(group)
        return deltas

    def pulled(self, msg: KvPulled) -> list[TokenDelta]:
        """A plan's pulls from prefill engines ended: their sequences wait in line again (or,
        a pull falling short under kv_load_failure_policy fail, end with an error)."""
        deltas = []
        for seq, load, short in self.arrivals.pulled(msg):
            self._back_in_line(seq)
            if short and self.config.kv_transfer_config.kv_load_failure_policy == "fail":
                deltas += self._fail(seq, f"the prefill engine's KV ({load.source.address}, "
                                     f"lease {load.source.lease}) could not be pulled")
        return deltas

    def _back_in_line(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.live.enqueue(seq)

    def _count_prompt(self, seq: Sequence) -> None:
        seq.request.prompt_counted = True    # the request's: one count per prompt
        self.num_prompt_tokens += seq.num_prompt_tokens

    def _append(self, seq: Sequence, result: StepResult, row: int) -> TokenDelta:
        """Append the row's token (and the drafts it verified, speculative decoding); the
        sequence ends at the first token that ends it."""
        tokens = self.drafts.tokens_of(seq, result.token_ids[row], result.drafts)
        appended, reason = seq.append_verified(tokens, self.eos_ids)
        self.num_generation_tokens += len(appended)
        if len(tokens) > 1:
            self.tables.commit(seq)
        logprobs = None
        if result.logprobs is not None:
            logprobs = self.drafts.logprobs_of(seq, result.token_ids[row], result.logprobs, row,
                                               result.drafts, len(appended))
            seq.cum_logprob += sum(logprobs.logprobs)
            if seq.sampling.logprobs is None:
                logprobs = None
        if reason:
            transfer = seq.request.transfer
            self._finish(seq, lease=transfer is not None and transfer.remote_decode)
        cum = seq.cum_logprob if reason and seq.sampling.logprobs is not None else None
        return TokenDelta(seq.seq_id, appended, reason, None, cum, logprobs)

    def _pooled(self, seq: Sequence, result: StepResult) -> TokenDelta:
        """A pooling sequence's prompt is computed: it ends with its pooled output."""
        vector = result.pooled.vectors.get(seq.seq_id) if result.pooled is not None else None
        self._finish(seq)
        if vector is None:
            return TokenDelta(seq.seq_id, [], "error", "the executor returned no pooled output")
        return TokenDelta(seq.seq_id, [], "stop", pooled=vector)

    def _fork(self, leader: Sequence) -> None:
        """Split a computed prompt into its sequences. They share its blocks; each one's first
        write (the last prompt token) copies the shared partial block."""
        for child in leader.output_forks():
            child.status = Status.RUNNING
            self._adopt(child)
        self._finish(leader)

    def _adopt(self, child: Sequence) -> None:
        """A forked sequence joins: it shares its parent's blocks and queues by its status."""
        self.tables.share(child)
        self.live.track(child)

    def _advance_beams(self, group: BeamGroup) -> list[TokenDelta]:
        """Every live beam has its candidates: keep the best `width` continuations (forking a
        beam chosen more than once, freeing one not chosen), then finish the group if done."""
        stop_ids = frozenset() if group.live[0].sampling.ignore_eos else self.eos_ids
        forks, dropped = group.advance(stop_ids)
        for child in forks:          # before the drops: a fork shares blocks they may free
            self._adopt(child)
        for beam in dropped:
            self._finish(beam)
        self.num_generation_tokens += len(group.live)   # one token appended to each
        for beam in group.retire_full_length():
            self._finish(beam)
        if not group.is_finished():
            return []
        for beam in list(group.live):
            self._finish(beam)
        del self.groups[group.req_id]
        return [TokenDelta(out_id, tokens, reason)
                for out_id, (tokens, reason) in zip(group.output_ids, group.results())]

    def _fail_step(self, scheduled: StepRows, error: str) -> list[TokenDelta]:
        """The executor could not run the step: fail every request it held."""
        deltas = []
        for seq, _ in scheduled:
            if seq.status is Status.RUNNING:
                deltas += self._fail(seq, error)
        return deltas

    def _fail(self, seq: Sequence, error: str) -> list[TokenDelta]:
        """End seq's request (a beam search's whole group) with an error."""
        ids = seq.output_ids
        if seq.request.group is not None:
            self.abort(ids)
        else:
            self._finish(seq)
        return [TokenDelta(i, [], "error", error) for i in ids]

    def end_lease(self, msg: KvLeaseEnded) -> list[TokenDelta]:
        """The decode engine released a lease (or it expired): free its blocks."""
        self.tables.end_lease(msg.lease)
        return []
