"""`pagewire replay DIR --actor scheduler|detokenizer|tokenizer`: feed a fresh actor the inbox
recorded in a trace, in recorded order, and diff what it sends against what was recorded,
stopping at the first divergence with both messages shown.

The scheduler replays with a fresh executor on the same model: at each recorded plan it plans,
runs the plan on the new executor, and uses that result where the recording has the old one
(and compares them). With the same model and configuration a replay matches exactly, seeded
and unseeded sampling included (the executor's random state starts from the config's seed).
The configuration is the recorded one; a model whose weights changed since is reported as such.
"""
from __future__ import annotations

import tempfile

from pagewire.wire.replay import (CannotReplay, Divergence, Replay, decode, differing_ids,
                                  recorded)
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import DetokenizerStarted, StepResult
from pagewire.wire.trace import TraceHeader

from .config import SECTIONS, EngineConfig
from .model_info import resolve_model

__all__ = ["replay", "differing_ids", "CannotReplay"]


class SchedulerReplay(Replay):
    """Drives the step engine (scheduler/engine.py) as the actor loop did, with a fresh
    executor in this process: where the recording sent a plan, the engine plans (compared with
    the recorded plan); where a result came, the new executor's result for the oldest plan in
    flight is compared with the recorded one and handed to the engine in its place."""

    def __init__(self, config: EngineConfig):
        super().__init__()
        from .executor.runner import ModelRunner
        from .scheduler.core import SchedulerCore
        from .scheduler.engine import InProcessExecutor, StepEngine
        # The executor keeps to itself: a disk tier of its own (never the recorded engine's
        # directory, which that engine may still be using), no KV server or pulls (a pull
        # finds nothing and is computed, as the recording's may not have been).
        scratch = tempfile.mkdtemp(prefix="pagewire-replay-kv-") if config.cache.kv_offload_dir \
            else None
        core = SchedulerCore(config.with_sections(kv_events_config=None))   # publishes nothing
        self.runner = ModelRunner(config.replace(kv_offload_dir=scratch, kv_transfer_config=None))
        # Each plan runs when its result is asked for: plans run in order, and a plan that
        # diverges from the recording is reported before it runs.
        self.engine = StepEngine(core, InProcessExecutor(self.runner.execute))

    def receive(self, msg) -> None:
        if isinstance(msg, StepResult):
            if not self.engine.num_in_flight:
                raise CannotReplay("the recording holds a step result for a plan it does not "
                                   "hold: it starts mid-run")
            ours = self.engine.next_result()
            if ours != msg:
                raise Divergence(self.index, "the executor's step result", msg, ours)
            msg = ours
        self.route(self.engine.handle(msg))

    def expect(self, channel: str, recorded) -> None:
        if isinstance(recorded, StepPlan):         # the recorded loop planned here: so do we
            plan = self.engine.plan()
            if plan != recorded:
                raise Divergence(self.index, f"plan sent to {channel}", recorded, plan)
        elif channel != "gateway":                 # scheduler statistics carry timings
            super().expect(channel, recorded)


class DetokenizerReplay(Replay):
    def __init__(self, config: EngineConfig):
        super().__init__()
        from .detokenizer import Detokenizer
        from .hf_tokenizer import load_tokenizer
        self.core = Detokenizer(load_tokenizer(config.model.model_info))

    def receive(self, msg) -> None:
        self.route(self.core.handle(msg))

    def expect(self, channel: str, recorded) -> None:
        if not isinstance(recorded, DetokenizerStarted):   # the actor's hello, not the core's
            super().expect(channel, recorded)


class TokenizerReplay(Replay):
    def __init__(self, config: EngineConfig):
        super().__init__()
        from .hf_tokenizer import load_tokenizer
        from .tokenizer import RequestTokenizer
        self.core = RequestTokenizer(config, load_tokenizer(config.model.model_info))

    def receive(self, msg) -> None:
        self.route(self.core.handle(msg))


DRIVERS = {"scheduler": SchedulerReplay, "detokenizer": DetokenizerReplay,
           "tokenizer": TokenizerReplay}


def replay_config(header: TraceHeader, overrides: dict) -> tuple[EngineConfig, list[str]]:
    """The recorded configuration with `overrides` applied, and what they changed."""
    config = EngineConfig.from_json(header.config_json.encode())
    recorded_digest = header.model_id.rsplit("@", 1)[1]
    info = resolve_model(overrides.get("model", config.model.model),
                         overrides.get("mmproj", config.model.mmproj))
    if info.digest != recorded_digest:
        raise CannotReplay(f"the model changed since the recording: it had weights "
                           f"{recorded_digest}, {info.path} now has {info.digest}; replay "
                           "needs the same model")
    changed = [f"{k}: {config.get(k)!r} -> {v!r}" for k, v in overrides.items()
               if config.get(k) != v]
    # An actor records the sections it holds (config.ACTOR_SECTIONS), resolved as they were.
    # Resolving again (to apply overrides) reads every section: the absent ones take their
    # defaults meanwhile and are dropped after.
    absent = [s for s in SECTIONS if getattr(config, s) is None]
    if absent and not overrides:
        return config, []
    config = config.with_sections(**{s: SECTIONS[s]() for s in absent})
    fresh = {"model_info": None} if {"model", "mmproj"} & set(overrides) else {}  # re-read
    if "speculative_config" in overrides:
        fresh["draft_model_info"] = None
    config = config.replace(**overrides, **fresh).resolve()
    return config.with_sections(**{s: None for s in absent}), changed


def replay(directory: str, actor: str, overrides: dict | None = None) -> int:
    """Replays every recorded instance of the actor kind, in name order, stopping at the first
    divergence. Returns the exit code: 0 no divergence, 1 a divergence, 2 cannot replay."""
    try:
        runs = recorded(directory, actor)
    except CannotReplay as e:
        print(f"cannot replay: {e}")
        return 2
    for header, records in runs:
        code = _replay_run(actor, header, records, overrides or {})
        if code:
            return code
    return 0


def _replay_run(actor: str, header: TraceHeader, records: list, overrides: dict) -> int:
    try:
        config, changed = replay_config(header, overrides)
    except CannotReplay as e:
        print(f"cannot replay: {e}")
        return 2
    if changed:
        print("the configuration differs from the recording, so a divergence is expected: "
              + "; ".join(changed))
    driver = DRIVERS[actor](config)
    try:
        for i, r in enumerate(records):
            driver.index = i
            driver.feed(r.direction, r.channel, decode(r.channel, r.frame, header.version))
        driver.finish()
    except Divergence as e:
        print(f"{header.actor} (pid {header.pid}): {e}")
        return 1
    except CannotReplay as e:
        print(f"cannot replay: {e}")
        return 2
    print(f"replayed {len(records)} records of the {actor} ({header.actor}, pid {header.pid}): "
          "no divergence")
    return 0
