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

from collections import defaultdict, deque

import msgspec

from pagewire.wire.to_detokenizer import DetokStart, TokenDeltas
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_gateway import TextDeltas
from pagewire.wire.to_scheduler import Abort, AbortAll, NewRequest, StepResult
from pagewire.wire.to_tokenizer import DetokenizeOnly, TokenizeOnly, TokenizeRequest
from pagewire.wire.trace import TraceHeader, read_trace, trace_files

from .config import EngineConfig
from .model_info import resolve_model
from .trace_tools import decode, request_ids


class Divergence(Exception):
    def __init__(self, index: int, where: str, recorded, replayed):
        self.req_ids = differing_ids(recorded, replayed)
        lines = [f"divergence at record {index} ({where}), requests {self.req_ids[:8]}"]
        a, b = _parts(recorded) or {}, _parts(replayed) or {}
        for rid in self.req_ids[:3] if a or b else []:
            lines += [f"  {rid} recorded: {a.get(rid)!r}", f"  {rid} replayed: {b.get(rid)!r}"]
        lines += [f"  recorded message: {recorded!r}", f"  replayed message: {replayed!r}"]
        super().__init__("\n".join(lines))


class CannotReplay(Exception):
    """The trace does not hold what a replay needs (exit 2, not a divergence)."""


def _parts(msg) -> dict | None:
    """A message's per-request parts, for messages that have them."""
    if isinstance(msg, StepResult):
        columns = [c for c in (msg.token_ids, msg.logprobs, msg.top_ids, msg.top_logprobs) if c]
        return {rid: tuple(c[i] for c in columns) for i, rid in enumerate(msg.req_ids)}
    if isinstance(msg, (TokenDeltas, TextDeltas)):
        return {d.req_id: d for d in msg.deltas}
    if isinstance(msg, StepPlan):
        return {s.req_id: s for s in msg.new} | {r.req_id: r for r in msg.running}
    return None


def differing_ids(recorded, replayed) -> list[str]:
    """The requests whose parts of two messages differ; every request they name when the
    messages have no per-request parts or are of different kinds."""
    a, b = _parts(recorded), _parts(replayed)
    if a is not None and b is not None:
        return sorted(r for r in a.keys() | b.keys() if a.get(r) != b.get(r))
    return sorted(set(request_ids(recorded) if recorded is not None else [])
                  | set(request_ids(replayed) if replayed is not None else []))


class Replay:
    """Feeds records in order; compares what the actor sends with the recording, per
    destination, in order."""

    def __init__(self):
        self.sent: dict[str, deque] = defaultdict(deque)    # destination -> our messages
        self.index = 0

    def send(self, channel: str, msg) -> None:
        self.sent[channel.split("-")[0]].append(msg)

    def feed(self, direction: str, channel: str, msg) -> None:
        if direction == "in":
            self.receive(msg)
        else:
            self.expect(channel, msg)

    def expect(self, channel: str, recorded) -> None:
        queue = self.sent[channel.split("-")[0]]
        replayed = queue.popleft() if queue else None
        if replayed != recorded:
            raise Divergence(self.index, f"sent to {channel}", recorded, replayed)

    def finish(self) -> None:
        for channel, queue in self.sent.items():
            if queue:
                raise Divergence(self.index, f"sent to {channel}, not in the recording",
                                 None, queue[0])


class SchedulerReplay(Replay):
    def __init__(self, config: EngineConfig):
        super().__init__()
        from .executor.runner import ModelRunner
        from .scheduler.scheduler import Scheduler
        self.sched, self.runner = Scheduler(config), ModelRunner(config)
        self.results: deque[StepResult] = deque()

    def receive(self, msg) -> None:
        if isinstance(msg, NewRequest):
            self.emit(self.sched.add(msg))
        elif isinstance(msg, Abort):
            self.emit(self.sched.abort(msg.req_ids))
        elif isinstance(msg, AbortAll):
            self.emit(self.sched.abort_all())
        elif isinstance(msg, StepResult):
            if not self.results:
                raise CannotReplay("the recording holds a step result for a plan it does not "
                                   "hold: it starts mid-run")
            ours = self.results.popleft()
            if ours != msg:
                raise Divergence(self.index, "the executor's step result", msg, ours)
            self.emit(self.sched.update(ours))

    def expect(self, channel: str, recorded) -> None:
        if isinstance(recorded, StepPlan):         # the recorded loop planned here: so do we
            plan = self.sched.schedule()
            if plan != recorded:
                raise Divergence(self.index, f"plan sent to {channel}", recorded, plan)
            self.results.append(self.runner.execute(plan))
        elif channel != "gateway":                 # scheduler statistics carry timings
            super().expect(channel, recorded)

    def emit(self, deltas) -> None:
        if deltas:
            self.send("detokenizer", TokenDeltas(deltas))


class DetokenizerReplay(Replay):
    def __init__(self, config: EngineConfig):
        super().__init__()
        from .detokenizer import Detokenizer
        from .hf_tokenizer import load_tokenizer
        self.detok = Detokenizer(load_tokenizer(config.model_info))

    def receive(self, msg) -> None:
        texts, aborts = (self.detok.start if isinstance(msg, DetokStart)
                         else self.detok.on_deltas)(msg)
        if texts:
            self.send("gateway", TextDeltas(texts))
        if aborts:
            self.send("scheduler", Abort(aborts))


class TokenizerReplay(Replay):
    def __init__(self, config: EngineConfig):
        super().__init__()
        from .hf_tokenizer import load_tokenizer
        from .tokenizer import RequestTokenizer
        self.tokenizer = RequestTokenizer(config, load_tokenizer(config.model_info))

    def receive(self, msg) -> None:
        if isinstance(msg, TokenizeOnly):
            self.send("gateway", self.tokenizer.tokenize_only(msg))
        elif isinstance(msg, DetokenizeOnly):
            self.send("gateway", self.tokenizer.detokenize_only(msg))
        elif isinstance(msg, TokenizeRequest):
            result = self.tokenizer.process(msg)
            if isinstance(result, tuple):
                self.send("detokenizer", result[0])
                self.send("scheduler", result[1])
            else:
                self.send("gateway", result)


DRIVERS = {"scheduler": SchedulerReplay, "detokenizer": DetokenizerReplay,
           "tokenizer": TokenizerReplay}


def recorded(directory: str, actor: str) -> list[tuple[TraceHeader, list]]:
    """Each instance of the actor kind (tokenizer 0, tokenizer 1, ...) with its records across
    its segments; an instance that ran more than once (a restart) by its last run. Raises
    CannotReplay when a run's start is missing (segments rotated away, or recording switched
    off for a while)."""
    runs: dict[str, dict[int, list[tuple[TraceHeader, str]]]] = defaultdict(lambda: defaultdict(list))
    for path in trace_files(directory):
        header, _ = read_trace(path)
        if header.actor.split()[0] == actor:
            runs[header.actor][header.pid].append((header, path))
    if not runs:
        raise CannotReplay(f"no trace of a {actor} in {directory}")
    return [_last_run(runs[name]) for name in sorted(runs)]


def _last_run(runs: dict[int, list[tuple[TraceHeader, str]]]) -> tuple[TraceHeader, list]:
    last = max(runs.values(), key=lambda files: files[0][0].started)
    last.sort(key=lambda hp: hp[0].segment)
    first, name = last[0][0], last[0][0].actor
    if first.segment != 0:
        raise CannotReplay(f"the {name}'s first {first.segment} trace segments were "
                           "rotated away (--trace-max-segments): a replay needs its start")
    if any(h.gap for h, _ in last):
        raise CannotReplay(f"recording was switched off during the {name}'s run, so its trace "
                           "has gaps: a replay needs every message since it started")
    if first.redacted:
        raise CannotReplay("this trace was recorded with --trace-redact: its content cannot "
                           "be replayed")
    return first, [r for _, path in last for r in read_trace(path)[1]]


def replay_config(header: TraceHeader, overrides: dict) -> tuple[EngineConfig, list[str]]:
    """The recorded configuration with `overrides` applied, and what they changed."""
    config = EngineConfig.from_json(header.config_json.encode())
    recorded_digest = header.model_id.rsplit("@", 1)[1]
    info = resolve_model(overrides.get("model", config.model))
    if info.digest != recorded_digest:
        raise CannotReplay(f"the model changed since the recording: it had weights "
                           f"{recorded_digest}, {info.path} now has {info.digest}; replay "
                           "needs the same model")
    changed = [f"{k}: {getattr(config, k)!r} -> {v!r}" for k, v in overrides.items()
               if getattr(config, k) != v]
    fresh = {"model_info": None} if "model" in overrides else {}     # re-read a new path
    config = msgspec.structs.replace(config, **overrides, **fresh).resolve()
    return config, changed


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
            driver.feed(r.direction, r.channel, decode(r.channel, r.frame))
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
