"""Reading traces back as typed messages, and the replayer's core: feed an actor's recorded
inbox in order and diff what it sends against what it sent then. The actor-specific drivers
(which actor to build, how it handles each message) are in the `pagewire replay` command,
actors/replay.py; this module imports only msgspec and wire/.
"""
from __future__ import annotations

from collections import defaultdict, deque

import msgspec

from .to_detokenizer import DetokenizerInbox, TokenDeltas
from .to_executor import ExecutorInbox, StepPlan
from .to_gateway import GatewayInbox, TextDeltas
from .to_scheduler import SchedulerInbox, StepResult
from .to_tokenizer import TokenizerInbox
from .trace import FORMAT_VERSION, TraceHeader, read_trace, trace_files
from .trace_v1 import decode_scheduler_frame

# A frame is decoded with the inbox type of the actor it went to (channel names are inboxes).
INBOXES = {"scheduler": SchedulerInbox, "executor": ExecutorInbox,
           "detokenizer": DetokenizerInbox, "gateway": GatewayInbox, "tokenizer": TokenizerInbox}
_DECODERS = {name: msgspec.msgpack.Decoder(t) for name, t in INBOXES.items()}


def inbox_of(channel: str) -> str:
    """The inbox a channel name points at: "tokenizer-1" -> "tokenizer"."""
    return channel.split("-")[0]


def decode(channel: str, frame: bytes, version: int = FORMAT_VERSION) -> msgspec.Struct:
    """A recorded frame as the message it is now; `version`: the trace's format (its header).
    Format 1 differs only in the scheduler's StepResult (trace_v1.py)."""
    inbox = inbox_of(channel)
    if version == 1 and inbox == "scheduler":
        return decode_scheduler_frame(frame)
    return _DECODERS[inbox].decode(frame)


def request_ids(msg) -> list[str]:
    """The ids of the requests a message concerns, in order of appearance."""
    if hasattr(msg, "req_id"):
        return [msg.req_id]
    if hasattr(msg, "deltas"):
        seqs = [d.seq_id for d in msg.deltas]
    elif hasattr(msg, "new"):                                 # StepPlan
        seqs = [s.seq_id for s in msg.new] + [r.seq_id for r in msg.running]
    else:
        seqs = getattr(msg, "seq_ids", [])
    return list(dict.fromkeys(s.req for s in seqs))


class Divergence(Exception):
    def __init__(self, index: int, where: str, recorded, replayed):
        self.ids = differing_ids(recorded, replayed)
        shown = ", ".join(map(str, self.ids[:8]))
        lines = [f"divergence at record {index} ({where}), sequences or requests [{shown}]"]
        a, b = _parts(recorded) or {}, _parts(replayed) or {}
        for sid in self.ids[:3] if a or b else []:
            lines += [f"  {sid} recorded: {a.get(sid)!r}", f"  {sid} replayed: {b.get(sid)!r}"]
        lines += [f"  recorded message: {recorded!r}", f"  replayed message: {replayed!r}"]
        super().__init__("\n".join(lines))


class CannotReplay(Exception):
    """The trace does not hold what a replay needs (exit 2, not a divergence)."""


def _parts(msg) -> dict | None:
    """A message's per-request parts, for messages that have them."""
    if isinstance(msg, StepResult):
        lps = msg.logprobs
        columns = [c for c in (msg.token_ids, lps and lps.logprobs, lps and lps.top_ids,
                               lps and lps.top_logprobs) if c]
        return {sid: tuple(c[i] for c in columns) for i, sid in enumerate(msg.seq_ids)}
    if isinstance(msg, (TokenDeltas, TextDeltas)):
        return {d.seq_id: d for d in msg.deltas}
    if isinstance(msg, StepPlan):
        return {s.seq_id: s for s in msg.new} | {r.seq_id: r for r in msg.running}
    return None


def differing_ids(recorded, replayed) -> list:
    """The sequences (SeqId) whose parts of two messages differ; every request (id) they name
    when the messages have no per-sequence parts or are of different kinds."""
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
        self.sent[inbox_of(channel)].append(msg)

    def route(self, sends) -> None:
        """What a core returned for one message (wire.channels.Sends), as the actor sends it."""
        for channel, msg in sends:
            self.send(channel, msg)

    def feed(self, direction: str, channel: str, msg) -> None:
        if direction == "in":
            self.receive(msg)
        else:
            self.expect(channel, msg)

    def expect(self, channel: str, recorded) -> None:
        queue = self.sent[inbox_of(channel)]
        replayed = queue.popleft() if queue else None
        if replayed != recorded:
            raise Divergence(self.index, f"sent to {channel}", recorded, replayed)

    def finish(self) -> None:
        for channel, queue in self.sent.items():
            if queue:
                raise Divergence(self.index, f"sent to {channel}, not in the recording",
                                 None, queue[0])


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
