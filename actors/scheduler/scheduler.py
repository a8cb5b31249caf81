"""The scheduler: the only owner of request state and of the KV block table.

Each step, schedule() picks which tokens of which requests run under one token budget shared by
decodes and prefill chunks (no separate phases): running requests first, in arrival order, then
waiting ones. When blocks run out, the latest-arriving running request is preempted by
recompute: its blocks are freed and it goes back to the front of the queue with all its tokens,
to be prefilled again. update() applies a StepResult: appends sampled tokens, finishes requests
(EOS, stop ids, max_tokens, context full) and frees their blocks.

Calls alternate: schedule() -> (executor runs the plan) -> update(). add() and abort() may come
at any time, including between schedule() and update(); update() skips requests that ended
meanwhile.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from pagewire.wire.to_detokenizer import TokenDelta
from pagewire.wire.to_executor import NewSeq, RunSeq, StepPlan
from pagewire.wire.to_scheduler import NewRequest, StepResult

from ..config import EngineConfig
from .kv_manager import BlockManager
from .request import Request, Status

_FORGET_ABORTS = 10_000   # aborted-before-arrival ids remembered


class Scheduler:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.kv = BlockManager(config.num_kv_blocks, config.block_size)
        self.eos_ids = frozenset(config.model_info.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.scheduled: list[Request] = []     # the plan in flight, in plan order
        self.to_drop: list[str] = []           # executor state to drop with the next plan
        self.aborted_early: OrderedDict[str, None] = OrderedDict()
        self.step_id = 0
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, msg: NewRequest) -> list[TokenDelta]:
        """Queue a request. Returns a final delta at once if it can never run."""
        if msg.req_id in self.aborted_early or msg.req_id in self.requests:
            self.aborted_early.pop(msg.req_id, None)
            return [TokenDelta(msg.req_id, [], "abort")]
        if len(msg.prompt_token_ids) >= self.config.max_model_len:
            return [TokenDelta(msg.req_id, [], "error", f"prompt of {len(msg.prompt_token_ids)} "
                               f"tokens does not fit max_model_len={self.config.max_model_len}")]
        req = Request(msg.req_id, msg.prompt_token_ids, msg.sampling, msg.arrival_time,
                      self.config.max_model_len)
        self.requests[req.req_id] = req
        self.waiting.append(req)
        return []

    def abort(self, req_ids: list[str]) -> list[TokenDelta]:
        """End these requests. Every id gets a final "abort" delta, known or not, so the
        detokenizer can forget it."""
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                self.aborted_early[rid] = None
                if len(self.aborted_early) > _FORGET_ABORTS:
                    self.aborted_early.popitem(last=False)
            else:
                self._finish(req)
        return [TokenDelta(rid, [], "abort") for rid in req_ids]

    def schedule(self) -> StepPlan | None:
        """Decide the next step. Returns None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        self.scheduled, budget, preempted = self._schedule_running(budget)
        if not preempted:
            self._admit_waiting(budget)
        if not self.scheduled:
            return None
        self.step_id += 1
        plan = StepPlan(self.step_id, [], [], self.to_drop)
        self.to_drop = []
        for req in self.scheduled:
            new_blocks = req.block_ids[req.num_blocks_sent:]
            req.num_blocks_sent = len(req.block_ids)
            if req.on_executor:
                plan.running.append(RunSeq(req.req_id, req.num_scheduled, new_blocks))
            else:
                req.on_executor = True
                plan.new.append(NewSeq(req.req_id, list(req.token_ids), req.num_prompt_tokens,
                                       req.num_computed, req.num_scheduled, list(req.block_ids),
                                       req.sampling))
        return plan

    def _schedule_running(self, budget: int) -> tuple[list[Request], int, bool]:
        scheduled, preempted, i = [], False, 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending, budget)
            if self._grow(req, n):
                req.num_scheduled = n
                scheduled.append(req)
                budget -= n
                i += 1
            else:
                # Out of blocks: preempt from the back (latest arrivals, never one already
                # scheduled this step) until req fits or is preempted itself.
                self._preempt(self.running[-1])
                preempted = True
        return scheduled, budget, preempted

    def _admit_waiting(self, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = req.num_pending
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self._grow(req, n):
                break
            self.waiting.popleft()
            req.status, req.num_scheduled = Status.RUNNING, n
            self.running.append(req)
            self.scheduled.append(req)
            budget -= n

    def _grow(self, req: Request, n: int) -> bool:
        """Give req the blocks to hold n more tokens; False (taking none) if too few are free."""
        need = self.kv.blocks_needed(req.num_computed + n, len(req.block_ids))
        if need > self.kv.num_free:
            return False
        req.block_ids += self.kv.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status, req.num_computed = Status.WAITING, 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        """Free req's blocks and have the executor drop its state."""
        self.kv.free(req.block_ids)
        req.block_ids, req.num_blocks_sent = [], 0
        if req.on_executor:
            self.to_drop.append(req.req_id)
            req.on_executor = False

    def _finish(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        del self.requests[req.req_id]

    def update(self, result: StepResult) -> list[TokenDelta]:
        """Apply the executor's result for the plan in flight; returns the token deltas."""
        if result.error is not None:
            return self._fail_step(result.error)
        sampled = dict(zip(result.req_ids, result.token_ids))
        deltas = []
        for req in self.scheduled:
            if req.status is not Status.RUNNING:   # aborted or preempted meanwhile
                continue
            req.num_computed += req.num_scheduled
            token = sampled.get(req.req_id)
            if token is None:                        # a prefill chunk that did not finish
                continue
            req.token_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason:
                self._finish(req)
            deltas.append(TokenDelta(req.req_id, [token], reason))
        self.scheduled = []
        return deltas

    def _stop_reason(self, req: Request, token: int) -> str | None:
        s = req.sampling
        if req.num_output_tokens > s.min_tokens:   # the executor masks them before that
            if (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
                return "stop"
        if req.num_output_tokens >= req.max_tokens:
            return "length"
        return None

    def _fail_step(self, error: str) -> list[TokenDelta]:
        """The executor could not run the step: fail every request it held."""
        failed = [r for r in self.scheduled if r.status is Status.RUNNING]
        for req in failed:
            self._finish(req)
        self.scheduled = []
        return [TokenDelta(r.req_id, [], "error", error) for r in failed]
