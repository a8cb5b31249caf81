"""The scheduler: the only owner of request state and of the KV block tables.

Each step, schedule() picks which tokens of which sequences run under one token budget shared
by decodes and prefill chunks (no separate phases): running sequences first, in (priority,
arrival) order, then waiting ones. A waiting prompt first maps whatever prefix of it is cached:
in the pool, then in the disk tier or, for a decode after a remote prefill, its prefill
engine's lease (those blocks are filled by the next step while the request waits, LOADING,
with its whole table allocated; block_tables.py). A request prefilled for a remote decode
leaves its full blocks under a lease when it ends, until the KV server says it ended.
When blocks run out, the last running sequence in that order is preempted: swapped to the host
tier when the policy allows and it fits, else recomputed (freed, requeued, prefilled again,
cheaply when its blocks are still cached). update() applies a StepResult: appends sampled
tokens, forks prompts into their n sequences, advances beams, finishes sequences (EOS, stop
ids, max_tokens, context full) and frees their blocks.

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

import bisect
from collections import OrderedDict

from pagewire.wire.ids import PROMPT, SeqId, output_ids
from pagewire.wire.to_detokenizer import TokenDelta
from pagewire.wire.kv_transfer import KvLeaseEnded, KvPulled
from pagewire.wire.to_executor import NewSeq, StepPlan
from pagewire.wire.to_scheduler import NewRequest, PromptPiece, StepResult

from ..config import EngineConfig
from .arrivals import Arrivals
from .beam import BeamGroup
from .block_tables import BlockTables
from .head_tables import CompressedTables
from .request import Request, Status, queue_refusal
from .speculation import DraftPolicy

_FORGET_ABORTS = 10_000   # aborted-before-arrival ids remembered

# A plan's sequences with the tokens each was scheduled for: what update() needs of the plan
# besides the StepPlan. Kept by the step engine's ledger until the plan's result comes.
StepRows = list[tuple[Request, int]]


class Scheduler:
    def __init__(self, config: EngineConfig, tier_present: list[bytes] | None = None):
        """tier_present: the block hashes the disk tier held at start (kv_tier_files.scan)."""
        self.config = config
        tables = BlockTables if config.kv_compress_rate is None else CompressedTables
        self.tables = tables.of(config, tier_present)
        self.kv = self.tables.device
        self.eos_ids = frozenset(config.model_info.eos_token_ids)
        self.by_priority = config.scheduling_policy == "priority"
        self.requests: dict[SeqId, Request] = {}   # every live sequence, by its id
        self.groups: dict[str, BeamGroup] = {}   # beam searches, by request id
        self.waiting: list[Request] = []         # sorted by key
        self.running: list[Request] = []         # sorted by key
        self.arrivals = Arrivals(self.tables)   # waiting for blocks (tier, prefill engine)
        # Sequences whose executor state the next plan drops: ended ones (plan.finished) and
        # preempted ones (plan.preempted).
        self.to_drop: list[SeqId] = []
        self.preempted_ids: list[SeqId] = []
        self.aborted_early: OrderedDict[SeqId, None] = OrderedDict()
        self.step_id = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0               # metrics counters; see the module docstring
        self.num_generation_tokens = 0
        self.drafts = DraftPolicy(config.speculative_config)   # scheduler/speculation.py; its counters
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
        s = msg.sampling
        outputs = output_ids(msg.req_id, s.num_outputs)
        early = [o for o in outputs if o in self.aborted_early]
        if early or any(sid.req == msg.req_id for sid in self.requests):   # or a duplicate
            for o in early:
                del self.aborted_early[o]
            return [TokenDelta(o, [], "abort") for o in outputs]
        refusal = queue_refusal(msg, self.config, self.waiting)
        if refusal:
            reason, error = refusal
            return [TokenDelta(o, [], reason, error) for o in outputs]
        priority = msg.priority if self.by_priority else 0
        req = Request(SeqId(msg.req_id), msg.prompt_token_ids, s, msg.arrival_time,
                      self.config.max_model_len, priority, msg.cache_salt, msg.lora)
        req.kv_transfer, req.prompt_open = msg.kv_transfer, msg.prompt_open
        if s.use_beam_search:
            group = self.groups[msg.req_id] = BeamGroup(msg.req_id, s, req.max_tokens)
            req.seq_id, req.group = group.new_id(), group
            group.live.append(req)
        elif s.num_sequences > 1:
            req.seq_id, req.fork_leader = SeqId(msg.req_id, PROMPT), True
        self.requests[req.seq_id] = req
        self._enqueue(req)
        if req.fork_leader and req.num_pending == 0:   # a one-token prompt: fork right away
            self._count_prompt(req)
            self._fork(req)                            # (_finish takes it out of waiting)
        return []

    def extend(self, msg: PromptPiece) -> list[TokenDelta]:
        """More of an open prompt (streaming input). Ignored once the request has ended."""
        req = self.requests.get(SeqId(msg.req_id))
        if req is None or not req.prompt_open:
            return []
        if len(req.token_ids) + len(msg.token_ids) >= self.config.max_model_len:
            return self._fail(req, f"the streamed prompt grew past max_model_len="
                                   f"{self.config.max_model_len}")
        req.extend_prompt(msg.token_ids, msg.last, self.config.max_model_len)
        return []

    def abort(self, seq_ids: list[SeqId]) -> list[TokenDelta]:
        """End these output sequences (a beam search's or an unforked prompt's whole request,
        by any of its output ids). Every id gets a final "abort" delta, known or not, so the
        detokenizer can forget it."""
        for sid in seq_ids:
            prompt = SeqId(sid.req, PROMPT)
            if sid in self.requests:
                self._finish(self.requests[sid])
            elif sid.req in self.groups:
                for beam in list(self.groups.pop(sid.req).live):
                    self._finish(beam)
            elif prompt in self.requests:
                self._finish(self.requests[prompt])
            elif sid not in self.aborted_early:
                self.aborted_early[sid] = None
                if len(self.aborted_early) > _FORGET_ABORTS:
                    self.aborted_early.popitem(last=False)
        return [TokenDelta(sid, [], "abort") for sid in seq_ids]

    def abort_all(self) -> list[TokenDelta]:
        """End every request, by the output ids the detokenizer and gateway know."""
        ids = dict.fromkeys(i for req in self.requests.values() for i in req.output_ids)
        return self.abort(list(ids))

    # -- planning ----------------------------------------------------------------------------

    def schedule(self, steps_in_flight: int = 0) -> tuple[StepPlan, StepRows] | None:
        """Decide the next step, given how many plans are in flight (their results not yet
        applied): the plan and its rows (for update()), or None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        self.first_scheduled = []
        self._make_room_for_priority()
        scheduled, budget, preempted = self._schedule_running(budget)
        if not preempted:   # blocks ran short for running work: admit nothing new this step
            scheduled += self._admit_waiting(budget)
            if not scheduled and not steps_in_flight and self._release_waiting_blocks():
                scheduled += self._admit_waiting(budget)
        tier = self.tables.tier.take_work() if self.tables.tier is not None else None
        pulls, leases = self.tables.take_pulls(), self.tables.take_leases()
        self.arrivals.planned(pulls)
        if not (scheduled or tier or pulls or leases):
            return None
        self.step_id += 1
        rows = [(req, req.num_scheduled) for req in scheduled]
        copies, swap_out, swap_in = self.tables.take_copies()
        plan = StepPlan(self.step_id, [], [], self.to_drop, copies, swap_out, swap_in,
                        self.preempted_ids, tier, leases, pulls)
        self.to_drop, self.preempted_ids = [], []
        for req in scheduled:
            entry = req.send_planned()
            (plan.new if isinstance(entry, NewSeq) else plan.running).append(entry)
        return plan, rows

    def _schedule_running(self, budget: int) -> tuple[list[Request], int, bool]:
        scheduled, preempted, i = [], False, 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending, budget)
            k = self.drafts.grant(req, budget - 1, len(self.running)) if n == 1 else 0
            grown = n > 0 and self.tables.grow(req, n + k)
            if not grown and k:        # no room for the drafts' slots: a plain decode
                k, grown = 0, self.tables.grow(req, n)
            if n == 0:                 # a beam waiting for its siblings' candidates
                i += 1
            elif grown:
                req.num_scheduled, req.num_draft_slots = n + k, k
                scheduled.append(req)
                budget -= n + k
                i += 1
            else:
                # Out of blocks: preempt from the back (lowest priority, latest arrival; never
                # one already scheduled this step) until req fits or is preempted itself.
                self._preempt(self.running[-1])
                preempted = True
        return scheduled, budget, preempted

    def _admit_waiting(self, budget: int) -> list[Request]:
        """Waiting sequences that start (or resume) in this step, in admission order. One whose
        adapter would make the running sequences' adapters more than max_loras waits, and
        those behind it go ahead."""
        admitted, i = [], 0
        loras = {r.lora.id for r in self.running if r.lora is not None}
        while i < len(self.waiting) and budget > 0 and \
                len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            lora = req.lora.id if req.lora is not None else None
            if lora is not None and lora not in loras and len(loras) >= self.config.max_loras:
                i += 1
                continue
            if req.status is Status.SWAPPED:
                if not self.tables.swap_in(req):
                    break
                req.status = Status.WAITING    # blocks back on the device; first in line
            fresh = not req.block_ids
            if fresh and self.tables.map_cached_prefix(req):   # it waits for its blocks
                self.waiting.pop(i)
                self.arrivals.wait(req)
                continue
            if fresh and req.kv_transfer is not None and req.kv_transfer.remote_prefill:
                self._forget_blocks(req)      # no room yet to pull its prefill engine's blocks
                break
            n = req.num_pending
            if n == 0 and req.prompt_open:     # all it has is its held-back last token
                if fresh:
                    self._forget_blocks(req)
                i += 1
                continue
            if n > budget and not self.config.enable_chunked_prefill:
                n = 0
            n = min(n, budget)
            if n == 0 or not self.tables.grow(req, n):
                if fresh:                      # give back the cached prefix it mapped
                    self._forget_blocks(req)
                break
            self.waiting.pop(i)
            if lora is not None:
                loras.add(lora)
            req.status, req.num_scheduled = Status.RUNNING, n
            if not req.scheduled_before:
                req.scheduled_before = True
                self.first_scheduled.append(req.arrival_time)
            self._enqueue(req)
            admitted.append(req)
            budget -= n
        return admitted

    def _release_waiting_blocks(self) -> bool:
        """Nothing runs or will (no plan in flight either: the caller checks): if waiting
        sequences hold device blocks (loaded from the disk tier, swapped in) that the first in
        line needs, they give them back (and recompute from the prefix cache) rather than wait
        on each other forever."""
        if self.running or self.arrivals.loading:
            return False
        holders = [r for r in self.waiting if r.block_ids and r.status is Status.WAITING]
        for req in holders:
            self._forget_blocks(req)
        return bool(holders)

    def _make_room_for_priority(self) -> None:
        """Under the priority policy, preempt running sequences of lower priority than the
        first waiting one while that one lacks the blocks for its next chunk."""
        if not self.by_priority:
            return
        while self.waiting and self.running and self.running[-1].priority > self.waiting[0].priority:
            head = self.waiting[0]
            need = self.kv.blocks_needed(min(head.num_pending, self.config.max_num_batched_tokens)
                                         + head.num_computed, len(head.block_ids))
            if need + len(head.host_block_ids) <= self.kv.num_free \
                    and len(self.running) < self.config.max_num_seqs:
                break
            self._preempt(self.running[-1])

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_from_executor(req, preempted=True)
        mode = self.config.preemption_mode
        if mode != "recompute" and self.tables.swap_out(req):
            req.status = Status.SWAPPED
        else:
            self._forget_blocks(req)
            req.status = Status.WAITING
        self._enqueue(req)
        self.num_preemptions += 1

    def _drop_from_executor(self, req: Request, preempted: bool = False) -> None:
        """The executor forgets req with the next plan; its steps in flight are ignored."""
        req.reset_in_flight()
        if req.on_executor:
            (self.preempted_ids if preempted else self.to_drop).append(req.seq_id)
            req.on_executor = False
            req.new_token_ids, req.num_drafts = [], 0    # its drafts went with its state
            req.new_prompt_ids = []                      # a NewSeq carries the whole prompt

    def _finish(self, req: Request, lease: bool = False) -> None:
        """Remove a sequence wherever it is and free its blocks (or, `lease`, hold them for a
        decode engine to pull: kv_transfer.py)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status in (Status.WAITING, Status.SWAPPED):
            self.waiting.remove(req)
        elif req.status is Status.LOADING:
            self.arrivals.abandon(req)
        if lease:
            self.tables.lease(req)
        self.tables.release(req)
        self._drop_from_executor(req)
        req.status = Status.FINISHED
        del self.requests[req.seq_id]
        if req.group is not None and req in req.group.live:
            req.group.live.remove(req)

    # -- results -----------------------------------------------------------------------------

    def update(self, plan: StepPlan, scheduled: StepRows,
               result: StepResult) -> list[TokenDelta]:
        """Apply the executor's result for `plan` (with the rows schedule() returned for it);
        returns the token deltas."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        for req in self.arrivals.tier_loaded(plan, result):
            self._back_in_line(req)
        if result.error is not None:
            return self._fail_step(scheduled, result.error)
        rows = {sid: i for i, sid in enumerate(result.seq_ids)}
        deltas, groups = [], []
        # A sequence preempted while in this step is RUNNING again only from a plan made after
        # this result (at most two plans are in flight): the status check tells them apart.
        for req, n in scheduled:
            if req.status is not Status.RUNNING:   # ended or preempted meanwhile
                continue
            if result.prompt_logprobs and req.seq_id in result.prompt_logprobs:
                fresh = req.fresh_prompt_logprobs(result.prompt_logprobs[req.seq_id])
                if fresh is not None:
                    deltas += [TokenDelta(i, [], prompt_logprobs=fresh) for i in req.output_ids]
            req.num_in_flight -= n
            req.num_computed += n - req.num_draft_slots    # drafts count once accepted
            if result.head_lens and req.seq_id in result.head_lens:
                self.tables.compressed(req, result.head_lens[req.seq_id])
            self.tables.commit(req)
            self.tables.drop_behind_window(req)
            reached_end = req.num_computed == req.target_len
            if not req.prompt_counted and reached_end and not req.prompt_open:
                self._count_prompt(req)
            row = rows.get(req.seq_id)
            if req.fork_leader:
                if reached_end:
                    self._fork(req)
            elif row is not None and req.group is not None:
                req.candidates = (result.top_ids[row], result.top_logprobs[row])
                if req.group not in groups:
                    groups.append(req.group)
            elif row is not None and result.errors and req.seq_id in result.errors:
                self._finish(req)
                deltas.append(TokenDelta(req.seq_id, [], "error", result.errors[req.seq_id]))
            elif row is not None:
                req.num_placeholders -= 1
                deltas.append(self._append(req, result, row))
        for group in groups:
            if group.ready():
                deltas += self._advance_beams(group)
        return deltas

    def pulled(self, msg: KvPulled) -> list[TokenDelta]:
        """A plan's pulls from prefill engines ended: their sequences wait in line again (or,
        a pull falling short under kv_load_failure_policy fail, end with an error)."""
        deltas = []
        for req, load, short in self.arrivals.pulled(msg):
            self._back_in_line(req)
            if short and self.config.kv_transfer_config.kv_load_failure_policy == "fail":
                deltas += self._fail(req, f"the prefill engine's KV ({load.source.address}, "
                                     f"lease {load.source.lease}) could not be pulled")
        return deltas

    def _back_in_line(self, req: Request) -> None:
        req.status = Status.WAITING
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Into its status's queue (running, else waiting), in key order."""
        queue = self.running if req.status is Status.RUNNING else self.waiting
        bisect.insort(queue, req, key=lambda r: r.key)

    def _forget_blocks(self, req: Request) -> None:
        """Give back req's device blocks: it computes from its first token again (cheaply,
        where its blocks stay in the prefix cache)."""
        self.tables.release(req)
        req.num_computed = 0

    def _count_prompt(self, req: Request) -> None:
        req.prompt_counted = True       # forks and beams copy the flag: one count per prompt
        self.num_prompt_tokens += req.num_prompt_tokens

    def _append(self, req: Request, result: StepResult, row: int) -> TokenDelta:
        """Append the row's token (and the drafts it verified, speculative decoding); the
        sequence ends at the first token that ends it."""
        tokens = self.drafts.tokens_of(req, result, row)
        appended, reason = req.append_verified(tokens, self.eos_ids)
        self.num_generation_tokens += len(appended)
        if len(tokens) > 1:
            self.tables.commit(req)
        logprobs = None
        if result.logprobs is not None:
            logprobs = self.drafts.logprobs_of(req, result, row, len(appended))
            req.cum_logprob += sum(logprobs.logprobs)
            if req.sampling.logprobs is None:
                logprobs = None
        if reason:
            self._finish(req, lease=req.kv_transfer is not None and req.kv_transfer.remote_decode)
        cum = req.cum_logprob if reason and req.sampling.logprobs is not None else None
        return TokenDelta(req.seq_id, appended, reason, None, cum, logprobs)

    def _fork(self, leader: Request) -> None:
        """Split a computed prompt into its sequences. They share its blocks; each one's first
        write (the last prompt token) copies the shared partial block."""
        for child in leader.output_forks():
            child.status = Status.RUNNING
            self._adopt(child)
        self._finish(leader)

    def _adopt(self, child: Request) -> None:
        """A forked sequence joins: it shares its parent's blocks and queues by its status."""
        self.tables.share(child)
        self.requests[child.seq_id] = child
        self._enqueue(child)

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
        for req, _ in scheduled:
            if req.status is Status.RUNNING:
                deltas += self._fail(req, error)
        return deltas

    def _fail(self, req: Request, error: str) -> list[TokenDelta]:
        """End req's request (a beam search's whole group) with an error."""
        ids = req.output_ids
        if req.group is not None:
            self.abort(ids)
        else:
            self._finish(req)
        return [TokenDelta(i, [], "error", error) for i in ids]

    def end_lease(self, msg: KvLeaseEnded) -> list[TokenDelta]:
        """The decode engine released a lease (or it expired): free its blocks."""
        self.tables.end_lease(msg.lease)
        return []
