"""Every driver runs through the step engine (scheduler/engine.py): the scheduler actor's loop,
`pagewire replay` and the offline LLM. A spy on StepEngine sees each plan the engine made and
each result it took; every plan an executor ran must be one of those, in order, and every
result it answered must have gone back through the engine."""
from __future__ import annotations

from collections import deque

import msgspec
import pytest

from pagewire.config import EngineConfig
from pagewire.scheduler.engine import StepEngine
from pagewire.wire.channels import encode
from pagewire.wire.replay import Divergence, decode
from pagewire.wire.sampling_params import SamplingParams
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import NewRequest, StepResult

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 9], [11, 12, 13, 14, 15], [8] * 9]


@pytest.fixture
def spy(monkeypatch):
    """What every StepEngine made and took: plans (with the plans in flight after each) and
    results, in order."""
    seen = {"plans": [], "in_flight": [], "results": []}
    plan, handle = StepEngine.plan, StepEngine.handle

    def spied_plan(self):
        made = plan(self)
        if made is not None:
            seen["plans"].append(made)
            seen["in_flight"].append(self.num_in_flight)
        return made

    def spied_handle(self, msg):
        if isinstance(msg, StepResult):
            seen["results"].append(msg)
        return handle(self, msg)
    monkeypatch.setattr(StepEngine, "plan", spied_plan)
    monkeypatch.setattr(StepEngine, "handle", spied_handle)
    return seen


def config_of(model: str, pipelined: bool) -> EngineConfig:
    return EngineConfig.from_options(model=model, dtype="float32", block_size=4, num_kv_blocks=64,
                        max_model_len=64, async_scheduling=pipelined).resolve()


def requests() -> list[NewRequest]:
    return [NewRequest(req_id=str(i), prompt_token_ids=p, sampling=GREEDY, arrival_time=0.0)
            for i, p in enumerate(PROMPTS)]


class Finished(Exception):
    """The scripted inbox is empty and the executor has nothing left to answer."""


class ScriptedEnv:
    """The scheduler actor's process environment in memory. Its inbox holds the script; the
    executor runs each plan it is sent at once, and its result enters the inbox only when the
    loop waits (so plans queue at the executor as over sockets). Every message in and out is
    kept as a trace records it (encoded, decoded)."""

    def __init__(self, config: EngineConfig, execute, script: list):
        self.config, self.execute = config, execute
        self.inbox, self.answers = deque(script), deque()
        self.records: list[tuple[str, str, msgspec.Struct]] = []
        self.executed: list[StepPlan] = []

    def pull(self, name: str, types):
        return self

    def push(self, name: str):
        env = self

        class Push:
            def send(self, msg):
                env.records.append(("out", name, decode(name, encode(msg))))
                if name == "executor-0":
                    env.executed.append(msg)
                    env.answers.append(env.execute(msg))
        return Push()

    def recv(self, timeout_ms: int | None):
        if not self.inbox and timeout_ms != 0:      # the loop waits: the executor answers
            if not self.answers:
                raise Finished
            self.inbox.append(self.answers.popleft())
        if not self.inbox:
            return None
        msg = self.inbox.popleft()
        self.records.append(("in", "scheduler", decode("scheduler", encode(msg))))
        return msg

    def ready(self) -> None:
        pass

    def heartbeat(self, step_running_for: float = 0.0) -> None:
        pass


def run_scheduler_loop(config: EngineConfig) -> ScriptedEnv:
    from pagewire.executor.runner import ModelRunner
    from pagewire.scheduler.actor import SchedulerLoop
    env = ScriptedEnv(config, ModelRunner(config).execute, requests())
    loop = SchedulerLoop(env)
    with pytest.raises(Finished):
        loop.run()
    assert loop.engine.num_in_flight == 0 and not loop.engine.has_work()
    return env


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_scheduler_actor_loop_runs_through_the_step_engine(tiny_llama, spy, pipelined):
    env = run_scheduler_loop(config_of(tiny_llama(), pipelined))
    assert len(env.executed) == 6 and env.executed == spy["plans"]   # 6 tokens, one batch
    assert all(a is b for a, b in zip(env.executed, spy["plans"]))     # the engine's own plans
    answered = [m for d, _, m in env.records if d == "in" and isinstance(m, StepResult)]
    assert answered == spy["results"] and len(answered) == len(env.executed)
    assert max(spy["in_flight"]) == (2 if pipelined else 1)
    deltas = [d for direction, channel, m in env.records if channel == "detokenizer"
              for d in m.deltas]
    assert sorted(sum(len(d.token_ids) for d in deltas if d.seq_id.req == str(i))
                  for i in range(len(PROMPTS))) == [6, 6, 6]


def test_replay_runs_through_the_step_engine_and_finds_a_changed_result(tiny_llama, spy):
    """The actor loop's records replay through a fresh engine and executor with no divergence:
    the same plans are made, the same results come; a recorded result changed is found."""
    from pagewire.replay import SchedulerReplay
    config = config_of(tiny_llama(), True)
    records = run_scheduler_loop(config).records
    recorded_plans = list(spy["plans"])
    spy["plans"].clear()
    spy["results"].clear()
    driver = SchedulerReplay(config)
    for i, record in enumerate(records):
        driver.index = i
        driver.feed(*record)
    driver.finish()
    assert spy["plans"] == recorded_plans and driver.engine.num_in_flight == 0
    assert spy["results"] == [m for d, _, m in records if isinstance(m, StepResult)]

    changed = next(i for i, (d, _, m) in enumerate(records)
                   if isinstance(m, StepResult) and m.token_ids)
    result = records[changed][2]
    records[changed] = ("in", "scheduler", msgspec.structs.replace(
        result, token_ids=[t + 1 for t in result.token_ids]))
    driver = SchedulerReplay(config)
    with pytest.raises(Divergence, match="the executor's step result"):
        for i, record in enumerate(records):
            driver.index = i
            driver.feed(*record)


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_offline_llm_runs_through_the_step_engine(tiny_llama, spy, pipelined):
    from pagewire import LLM
    llm = LLM(tiny_llama(), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              async_scheduling=pipelined)
    executed, answered = [], []
    launch, finish = llm.runner.launch, llm.runner.finish    # execute() is the two in one

    def launched(plan, after=None, plain=None):
        executed.append(plan)
        return launch(plan, after, plain)

    def finished(step):
        answered.append(finish(step))
        return answered[-1]
    llm.runner.launch, llm.runner.finish = launched, finished
    outs = llm.generate(PROMPTS, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert len(executed) == 6 and all(a is b for a, b in zip(executed, spy["plans"]))
    assert len(executed) == len(spy["plans"])
    assert all(a is b for a, b in zip(answered, spy["results"]))
    assert len(answered) == len(spy["results"])
    assert max(spy["in_flight"]) == (2 if pipelined else 1)
    assert llm.engine.num_in_flight == 0
