"""The scheduler actor: the socket driver of the step engine (engine.py).

    drain inbox (NewRequest, Abort, StepResult) -> engine.handle() -> TokenDeltas to the
    detokenizer; engine.plan() -> the plan to executor-0 (SocketExecutor)

With async scheduling two plans are in flight (engine.py): the next step is planned and queued
at the executor while the current one runs. The inbox is drained without blocking while there
is work to plan, and blocks when waiting for a result or when idle (with a timeout while a
metrics report or log line is due).

Metrics: the loop times steps and queueing and sends a SchedulerStats to the gateway about once
a second while busy, once on going idle, and every 2 seconds regardless (the gateway's /health
reads it as the engine's heartbeat); every 5 seconds while busy it logs vLLM's line
(throughput, running/waiting, KV cache usage, prefix cache hit rate).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from pagewire.wire.kv_event_publisher import publisher_for
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_gateway import SchedulerStats
from pagewire.wire.to_scheduler import AbortAll, SchedulerInbox, StepResult

from .. import kv_tier_files
from .core import SchedulerCore
from .engine import SocketExecutor, StepEngine
from .scheduler import Scheduler

log = logging.getLogger(__name__)

REPORT_INTERVAL = 1.0   # seconds between SchedulerStats while busy
HEARTBEAT_INTERVAL = 2.0   # a SchedulerStats at least this often, busy or not: engine liveness
LOG_INTERVAL = 5.0      # seconds between throughput log lines while busy


class StatsReporter:
    """Collects the scheduler's metrics between reports and decides when to report and log.

    The loop calls on_message / on_plan / on_result as things happen, and tick(busy) after each
    round; tick sends what is due and returns how long the loop may block before the next tick
    is needed (None: until a message comes). Clocks and the sender are injectable for tests.
    """

    def __init__(self, sched: Scheduler, send: Callable[[SchedulerStats], None],
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.sched, self.send = sched, send
        self.clock, self.wall_clock = clock, wall_clock
        self.inbox_messages: dict[str, int] = {}
        self.iteration_tokens: list[int] = []
        self.queue_times: list[float] = []
        self.step_durations: list[float] = []
        # When each plan in flight was sent, oldest first; and when the latest result came: a
        # step queued behind another starts when that one's result comes back.
        self.plans_sent_at: deque[float] = deque()
        self.result_at = 0.0
        now = clock()
        self.reported_at, self.dirty = now, False
        self.logged_at, self.logged_totals = now, self._totals()
        self.logged_drafts = (0, 0, 0)            # drafts, draft tokens, accepted: last logged
        self.logged_experts = (0, 0)              # expert reads, MoE steps: last logged
        self.quiet = True        # idle with nothing left to log: the log interval restarts

    # -- events --------------------------------------------------------------------------------

    def on_message(self, msg) -> None:
        name = type(msg).__name__
        self.inbox_messages[name] = self.inbox_messages.get(name, 0) + 1
        self.dirty = True
        if self.quiet:           # activity after a quiet spell: time the log interval from now
            self.logged_at, self.logged_totals, self.quiet = self.clock(), self._totals(), False

    def on_plan(self, plan: StepPlan) -> None:
        self.plans_sent_at.append(self.clock())
        self.iteration_tokens.append(sum(s.num_scheduled for s in plan.new)
                                     + sum(r.num_scheduled for r in plan.running))
        if self.sched.first_scheduled:
            wall = self.wall_clock()
            self.queue_times += [max(0.0, wall - t) for t in self.sched.first_scheduled]
        self.dirty = True

    def on_result(self) -> None:
        if self.plans_sent_at:
            now = self.clock()
            self.step_durations.append(now - self._step_started())
            self.plans_sent_at.popleft()
            self.result_at = now

    def _step_started(self) -> float:
        """When the executor began the oldest plan in flight: when it was sent, or when the
        step before it came back, whichever is later."""
        return max(self.plans_sent_at[0], self.result_at)

    # -- reporting -----------------------------------------------------------------------------

    def tick(self, busy: bool) -> float | None:
        """Report and log what is due; return seconds until the next tick is due, or None."""
        now = self.clock()
        if (self.dirty and (not busy or now - self.reported_at >= REPORT_INTERVAL)) \
                or now - self.reported_at >= HEARTBEAT_INTERVAL:
            self.report(now)
        totals = self._totals()
        pending = totals[:2] != self.logged_totals[:2]
        if (busy or pending) and now - self.logged_at >= LOG_INTERVAL:
            self.log_line(now, totals)
            pending = False
        self.quiet = not busy and not pending
        waits = [self.reported_at + HEARTBEAT_INTERVAL - now]
        if busy:
            waits.append(self.reported_at + REPORT_INTERVAL - now)
        if busy or pending:
            waits.append(self.logged_at + LOG_INTERVAL - now)
        return max(0.0, min(waits))

    def stats(self) -> SchedulerStats:
        s, tables = self.sched, self.sched.tables
        return SchedulerStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            kv_cache_usage=s.kv_cache_usage(), prompt_tokens=s.num_prompt_tokens,
            generation_tokens=s.num_generation_tokens, preemptions=s.num_preemptions,
            prefix_cache_queries=tables.prefix_queries, prefix_cache_hits=tables.prefix_hits,
            inbox_messages=dict(self.inbox_messages), iteration_tokens=self.iteration_tokens,
            queue_times=self.queue_times, step_durations=self.step_durations,
            step_running_for=self.step_running_for(), spec_drafts=s.drafts.num_drafts,
            spec_draft_tokens=s.drafts.num_draft_tokens,
            spec_accepted_tokens=s.drafts.num_accepted_tokens,
            spec_accepted_per_pos=list(s.drafts.accepted_per_pos),
            running_loras=_adapters(s.running), waiting_loras=_adapters(s.waiting),
            experts_read=s.num_experts_read, moe_steps=s.num_moe_steps,
            encoder_cache_queries=s.encoder.queries, encoder_cache_hits=s.encoder.hits,
            encoder_seconds=s.encoder.seconds,
            **_tier_stats(tables, s.config))

    def step_running_for(self) -> float:
        """How long the executor has been on its current step (0.0: no step in flight)."""
        return self.clock() - self._step_started() if self.plans_sent_at else 0.0

    def report(self, now: float) -> None:
        self.send(self.stats())
        self.iteration_tokens, self.queue_times, self.step_durations = [], [], []
        self.reported_at, self.dirty = now, False

    def log_line(self, now: float, totals: tuple[int, int, int, int]) -> None:
        elapsed = max(now - self.logged_at, 1e-9)
        prompt, gen, queries, hits = (a - b for a, b in zip(totals, self.logged_totals))
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                 "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                 "Prefix cache hit rate: %.1f%%", prompt / elapsed, gen / elapsed,
                 len(self.sched.running), len(self.sched.waiting),
                 100 * self.sched.kv_cache_usage(), 100 * hits / queries if queries else 0.0)
        self.log_drafts()
        self.log_experts()
        self.logged_at, self.logged_totals = now, totals

    def log_experts(self) -> None:
        """A mixture of experts' reads over the steps since the last line."""
        s = self.sched
        now = (s.num_experts_read, s.num_moe_steps)
        reads, steps = (a - b for a, b in zip(now, self.logged_experts))
        self.logged_experts = now
        if steps:
            log.info("MoE: %.1f experts read a step (each chosen expert once a layer), "
                     "over %d steps", reads / steps, steps)

    def log_drafts(self) -> None:
        """vLLM's speculative decoding line, over the drafts verified since the last one."""
        d = self.sched.drafts
        now = (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens)
        drafts, tokens, accepted = (a - b for a, b in zip(now, self.logged_drafts))
        self.logged_drafts = now
        if drafts:
            log.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                     "Drafted: %d tokens, Draft acceptance rate: %.1f%%",
                     1 + accepted / drafts, accepted, tokens, 100 * accepted / tokens)

    def _totals(self) -> tuple[int, int, int, int]:
        s = self.sched
        return (s.num_prompt_tokens, s.num_generation_tokens, s.tables.prefix_queries,
                s.tables.prefix_hits)


class SchedulerLoop:
    """Moves messages between the inbox, the step engine and the sockets; the behaviour is the
    engine's and its core's (engine.py, core.py)."""

    def __init__(self, env):
        self.env = env
        core = SchedulerCore(env.config, tier_present=kv_tier_files.present(env.config))
        self.core = core
        self.kv_events = publisher_for(env.config.kv_events_config)
        self.inbox = env.pull("scheduler", SchedulerInbox)
        self.engine = StepEngine(core, SocketExecutor([env.push("executor-0")]))
        gateway = env.push("gateway")
        self.pushes = {"detokenizer": env.push("detokenizer"), "gateway": gateway}
        self.stats = StatsReporter(self.engine.scheduler, gateway.send)

    def run(self) -> None:
        wait: float | None = 0.0       # tick() at once: heartbeats and reports start now
        while True:
            can_plan = self.engine.can_plan()
            msg = self.inbox.recv(0 if can_plan else None if wait is None else int(wait * 1000) + 1)
            while msg is not None:
                self.stats.on_message(msg)
                if isinstance(msg, StepResult):
                    self.stats.on_result()
                elif isinstance(msg, AbortAll):
                    log.warning("aborting every request: %s", msg.reason)
                for channel, out in self.engine.handle(msg):
                    self.pushes[channel].send(out)
                msg = self.inbox.recv(0)
            plan = self.engine.plan()           # sent to the executors
            if isinstance(plan, StepPlan):      # (not a sleep-mode control)
                self.stats.on_plan(plan)
            if self.kv_events is not None:      # one batch a round: a step's events
                batch = self.core.take_kv_events()
                if batch is not None:
                    self.kv_events.publish(batch)
            busy = self.engine.busy()
            wait = self.stats.tick(busy)
            self.env.heartbeat(self.stats.step_running_for())


def run(env) -> None:
    loop = SchedulerLoop(env)
    env.ready()
    loop.run()


def _tier_stats(tables, config) -> dict[str, int]:
    """The disk tier's counters; a prefill engine's blocks count as external hits too."""
    external = dict(external_prefix_cache_queries=tables.external_queries,
                    external_prefix_cache_hits=tables.external_hits)
    tier = tables.tier
    if tier is None:
        return external
    size = config.cache.kv_block_bytes
    return dict(external, kv_offload_stores=tier.stores, kv_offload_loads=tier.loads,
                kv_offload_load_failures=tier.failures, kv_offload_bytes_stored=tier.stores * size,
                kv_offload_bytes_loaded=tier.hits * size, kv_offload_blocks=len(tier))


def _adapters(seqs) -> list[str]:
    return sorted({s.request.lora.name for s in seqs if s.request.lora is not None})
