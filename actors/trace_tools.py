"""`pagewire trace show|stats DIR`: read the traces an engine recorded with --trace DIR.

    pagewire trace show DIR [--request ID] [--actor NAME] [--type MessageType]
                            [--since SECONDS] [--until SECONDS]
    pagewire trace stats DIR
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import msgspec

from pagewire.wire.replay import decode, request_ids
from pagewire.wire.trace import TraceHeader, read_trace, trace_files

@dataclass
class Event:
    """One recorded frame, decoded."""
    actor: str
    direction: str
    channel: str
    mono: float
    wall: float
    size: int
    msg: msgspec.Struct

    @property
    def type(self) -> str:
        return type(self.msg).__name__


def load(directory: str) -> tuple[list[TraceHeader], list[Event]]:
    """Every actor's records, in wall-clock order (processes share the machine's clock)."""
    headers, events = [], []
    for path in trace_files(directory):
        header, records = read_trace(path)
        headers.append(header)
        for r in records:
            events.append(Event(header.actor, r.direction, r.channel, r.mono, r.wall,
                                len(r.frame), decode(r.channel, r.frame, header.version)))
    events.sort(key=lambda e: e.wall)
    return headers, events


def show(directory: str, request: str | None = None, actor: str | None = None,
         type_name: str | None = None, since: float | None = None,
         until: float | None = None) -> None:
    headers, events = load(directory)
    if not events:
        print("no records")
        return
    t0 = events[0].wall
    for e in events:
        at = e.wall - t0
        ids = request_ids(e.msg)
        if request and not any(request in i for i in ids):
            continue
        if (actor and actor not in e.actor) or (type_name and e.type != type_name) \
                or (since is not None and at < since) or (until is not None and at > until):
            continue
        arrow = "<-" if e.direction == "in" else "->"
        shown = ", ".join(ids[:4]) + (f" (+{len(ids) - 4})" if len(ids) > 4 else "")
        print(f"{at:10.4f}s  {e.actor:12} {arrow} {e.channel:12} {e.type:14} {e.size:6}B  {shown}")


def stats(directory: str) -> None:
    headers, events = load(directory)
    if not events:
        print("no records")
        return
    span = max(events[-1].wall - events[0].wall, 1e-9)
    print(f"{len(events)} records from {len(headers)} files over {span:.1f} s; actors: "
          + ", ".join(sorted({h.actor for h in headers})))
    by_kind = defaultdict(list)
    for e in events:
        by_kind[(e.actor, e.direction, e.type)].append(e.size)
    print(f"\n{'actor':12} {'dir':3} {'message':16} {'count':>7} {'per s':>8} {'mean B':>8} {'max B':>8}")
    for (actor, direction, type_name), sizes in sorted(by_kind.items()):
        print(f"{actor:12} {direction:3} {type_name:16} {len(sizes):7} {len(sizes) / span:8.1f} "
              f"{statistics.mean(sizes):8.0f} {max(sizes):8}")
    hops = hop_latencies(events)
    if hops:
        print("\nper-request latency between actors (ms): median, p90, max over requests")
        for hop, values in hops.items():
            values = sorted(v * 1000 for v in values)
            print(f"  {hop:48} {statistics.median(values):8.2f} "
                  f"{values[int(0.9 * (len(values) - 1))]:8.2f} {values[-1]:8.2f}  (n={len(values)})")


# The first appearance of a request at each point of its path, in path order.
_PATH = [("gateway", "out", "TokenizeRequest"), ("tokenizer", "in", "TokenizeRequest"),
         ("scheduler", "in", "NewRequest"), ("scheduler", "out", "StepPlan"),
         ("scheduler", "out", "TokenDeltas"), ("detokenizer", "in", "TokenDeltas"),
         ("detokenizer", "out", "TextDeltas"), ("gateway", "in", "TextDeltas")]


def hop_latencies(events: list[Event]) -> dict[str, list[float]]:
    first: dict[str, dict[int, float]] = defaultdict(dict)
    for e in events:
        role = e.actor.split()[0]
        for i, (actor, direction, type_name) in enumerate(_PATH):
            if role == actor and e.direction == direction and e.type == type_name:
                for rid in request_ids(e.msg):
                    first[rid].setdefault(i, e.wall)
    hops: dict[str, list[float]] = {}
    for points in first.values():
        seen = sorted(points)
        for a, b in zip(seen, seen[1:]):
            name = f"{_PATH[a][0]} {_PATH[a][2]} -> {_PATH[b][0]} {_PATH[b][2]}"
            hops.setdefault(name, []).append(points[b] - points[a])
    return hops
