"""Sleep mode and weight updates (--enable-sleep-mode): control messages that cross the whole
engine, gateway -> scheduler -> executor 0 (-> ranks 1..N-1), answered back the same way.

The gateway sends one of SleepEngine, WakeEngine, UpdateWeights to the scheduler; the scheduler
ends or drains the requests in flight (`mode`), clears its prefix cache, then hands the same
message to the executors in the place of a StepPlan (plans run in order, so every step sent
before it has run). Executor 0 answers ControlDone to the scheduler, which updates its own
state and forwards the ControlDone to the gateway (routed there by req_id). One control
operation is in flight at a time; another one meanwhile is answered with status 409.
"""
from __future__ import annotations

import msgspec

# What an engine can hold asleep (vLLM's wake_up tags): its weights and its KV pool.
WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)
# How the requests in flight meet a control: `abort` ends them at once (finish_reason
# "abort"), `wait` lets them finish while new ones are refused (503).
MODES = ABORT, WAIT = ("abort", "wait")


class SleepEngine(msgspec.Struct, tag=True, kw_only=True):
    """Free the KV pool (its content is forgotten) and, level 1, move the weights to host
    memory (on a CPU they stay where they are: they are in host memory), level 2, drop them
    (read again from the model's path on waking)."""
    req_id: str
    level: int = 1
    mode: str = ABORT


class WakeEngine(msgspec.Struct, tag=True, kw_only=True):
    """Bring back what `tags` names (empty: everything asleep); the engine serves again once
    nothing is asleep. Waking what is awake changes nothing."""
    req_id: str
    tags: list[str] = []


class UpdateWeights(msgspec.Struct, tag=True, kw_only=True):
    """Load the weights at `path` (the served model's kind: a GGUF file or a Hugging Face
    directory, of the same architecture and shapes, checked by the gateway first) in the
    place of the current ones; the prefix cache is cleared. Works asleep too (the weights are
    then awake after it; the KV pool stays as it was)."""
    req_id: str
    path: str
    mode: str = WAIT


class ControlDone(msgspec.Struct, tag=True, kw_only=True):
    """The answer to one control, executor 0 -> scheduler -> gateway. `asleep`: what the
    engine holds asleep now (TAGS' order); `status` an HTTP status (200, or 400/409/500 with
    `error`); `aborted`: requests the control ended (mode abort)."""
    req_id: str
    asleep: list[str] = []
    status: int = 200
    error: str | None = None
    aborted: int = 0


EngineControl = SleepEngine | WakeEngine | UpdateWeights
