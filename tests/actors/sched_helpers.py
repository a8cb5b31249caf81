"""Driving the scheduler core in tests as the scheduler actor drives it: messages in
(NewRequest, Abort, StepResult), plans out, each plan run in order by the executor's own
bookkeeping (executor/seq_table.py) with chosen tokens in place of a model."""
from __future__ import annotations

import contextlib
from collections import deque

from pagewire.config import EngineConfig
from pagewire.executor.seq_table import SeqTable
from pagewire.model_info import ModelInfo
from pagewire.wire.ids import PROMPT, SeqId, beam
from pagewire.scheduler.core import SchedulerCore
from pagewire.scheduler.engine import StepEngine
from pagewire.wire.sampling_params import SamplingParams
from pagewire.wire.to_detokenizer import TokenDelta
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import (Abort, AbortAll, NewRequest, SampledLogprobs, StepResult,
                                         TierResult)

EOS = 2


def sid(name: str) -> SeqId:
    """A sequence by the name it prints as: "a", "p#1", "p#prompt", "q#beam0"."""
    req, _, index = name.partition("#")
    if index.startswith("beam"):
        return beam(req, int(index[4:]))
    return SeqId(req, PROMPT if index == "prompt" else int(index or 0))


def ids(*names: str) -> list[SeqId]:
    return [sid(n) for n in names]


def names(seq_ids) -> list[str]:
    return [str(s) for s in seq_ids]


class HeldPlans:
    """An executor handle that keeps the plans sent to it for Driven.run() to execute."""

    def __init__(self):
        self.not_run: deque[StepPlan] = deque()

    def send(self, plan: StepPlan) -> None:
        self.not_run.append(plan)

    def collect(self, ticket) -> StepResult:
        raise AssertionError("Driven sends results as messages, as over sockets")


class Driven:
    """A step engine behind messages, and the executor's sequence table running its plans.

    add / abort / abort_all / update send the engine a message and return the TokenDeltas it
    sends the detokenizer; schedule() is the engine's plan(); run() executes the oldest plan not
    yet run. The scheduler's state (running, waiting, kv, counters) reads through."""

    def __init__(self, config: EngineConfig, depth: int | None = 1):
        self.core = SchedulerCore(config)
        self.held = HeldPlans()
        self.engine = StepEngine(self.core, self.held, depth)
        self.executor = SeqTable(list(config.model.model_info.eos_token_ids))
        self.not_run = self.held.not_run

    def __getattr__(self, name):
        return getattr(self.core.sched, name)

    def send(self, msg) -> list[TokenDelta]:
        return [d for _, out in self.engine.handle(msg) for d in out.deltas]

    def add(self, msg: NewRequest) -> list[TokenDelta]:
        return self.send(msg)

    def abort(self, seqs: list[str | SeqId]) -> list[TokenDelta]:
        return self.send(Abort([sid(s) if isinstance(s, str) else s for s in seqs]))

    def abort_all(self) -> list[TokenDelta]:
        return self.send(AbortAll("test"))

    def schedule(self) -> StepPlan | None:
        return self.engine.plan()

    def run(self, tokens: dict[str, int] | None = None, default: int = 5,
            result: StepResult | None = None, model=None) -> StepResult:
        """Execute the oldest plan not yet run: `result` as given, else every sequence that
        samples gets model(its SeqState) when a model is given, else the token `tokens` names
        for it, else `default`; beams get the candidates tok, tok + 1, ... with logprobs
        -1, -2, ..."""
        plan = self.not_run.popleft()
        order = self.executor.apply(plan)
        samplers = [(rid, seq) for rid, seq in order if seq.samples]
        if result is None:
            toks = [model(seq) if model else (tokens or {}).get(str(s), default)
                    for s, seq in samplers]
            result = StepResult(plan.step_id, [s for s, _ in samplers], toks)
            if plan.tier is not None and plan.tier.loads:     # every tier block arrives
                result.tier = TierResult({load.seq_id: len(load.block_ids)
                                          for load in plan.tier.loads})
            if any(seq.sampling.use_beam_search for _, seq in samplers):
                k = [2 * s.sampling.num_sequences if s.sampling.use_beam_search else 0
                     for _, s in samplers]
                result.logprobs = SampledLogprobs([0.0] * len(toks),
                                                  [[t + i for i in range(n)]
                                                   for t, n in zip(toks, k)],
                                                  [[-1.0 - i for i in range(n)] for n in k])
        if result.error is not None:            # as the executor actor does on an error
            self.executor.fail(plan)
            return result
        by_id = dict(zip(result.seq_ids, result.token_ids))
        self.executor.finish_step(order, [(r, s, [by_id[r]]) for r, s in samplers
                                          if r in by_id])
        return result

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenDelta]:
        """Apply a result (the plan is run first if it has not been)."""
        if plan in self.not_run:
            assert self.not_run[0] is plan, "plans run in order"
            self.run(result=result)
        return self.send(result)


def make_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=8, max_len=64, chunked=True,
                   window=None, depth: int | None = 1, **options) -> Driven:
    info = ModelInfo(path="/dev/null", format="hf", name="m", architecture="LlamaForCausalLM",
                     max_model_len=max_len, vocab_size=100, num_layers=1, num_kv_heads=1,
                     head_dim=8, eos_token_ids=[EOS], digest="0", sliding_window=window)
    config = EngineConfig.from_options(model_info=info, num_kv_blocks=num_blocks,
                                       block_size=block_size, max_num_batched_tokens=budget,
                                       max_num_seqs=max_seqs, enable_chunked_prefill=chunked,
                                       **options).resolve()
    return Driven(config, depth)


def new(rid, n_prompt, first=None, **sampling) -> NewRequest:
    """A request whose prompt is distinct per id (no accidental prefix hits) unless `first`
    (the first token id) is given."""
    sampling.setdefault("max_tokens", 100)
    first = 1000 * (1 + sum(map(ord, rid))) if first is None else first
    return NewRequest(req_id=rid, prompt_token_ids=list(range(first, first + n_prompt)),
                      sampling=SamplingParams(**sampling), arrival_time=0.0)


def step(sched: Driven, tokens: dict[str, int] | None = None, default=5):
    """Plan, run and apply one step; `default` sampled for every sequence that samples."""
    plan = sched.schedule()
    assert plan is not None
    return plan, sched.update(plan, sched.run(tokens, default))


def assert_pool_whole(sched: Driven) -> None:
    kv = sched.kv
    assert kv.num_free == kv.num_blocks
    assert not any(kv.refcount)
    assert sorted(kv.free_queue) == list(range(kv.num_blocks))
    assert all(kv.hash_of[b] == h for h, b in kv.cached.items())
    host = sched.tables.host
    assert host is None or (host.num_free == host.num_blocks and not any(host.refcount))


@contextlib.contextmanager
def schedulers(finish):
    """Yields make(**kw) -> make_scheduler(**kw); on exit each scheduler made is ended by
    `finish(sched)` (abort everything, or run its work out) and its pool checked whole."""
    made = []

    def make(**kw):
        made.append(make_scheduler(**kw))
        return made[-1]
    yield make
    for sched in made:
        finish(sched)
        assert_pool_whole(sched)
