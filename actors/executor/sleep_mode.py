"""Sleep mode in the executor: free the KV pool and park or drop the weights, bring them back,
or load new weights in their place (wire/engine_control.py). Every rank runs the same control,
in plan order; the scheduler sends one only when it holds no sequence and no plan is in
flight, so the runner's sequence table is emptied with it.

What each level does here:
- the KV pool (and what is built over it: the fused decode program, decode graphs, a drafting
  model's caches) is freed at either level; it is allocated afresh, zeroed, on waking;
- level 1, weights on a device (CUDA): every tensor of the model is copied to pinned host
  memory and its device memory released (`park`: each tensor object keeps its identity, so
  whatever holds the tensor reads the restored one; decode graphs are captured again with the
  pool). Weights in host memory (every CPU backend) stay as they are: they are in host memory
  already, and the backends' laid-out copies (packed, tiled, on huge pages, with address
  tables built over them) would cost a reload to rebuild. "weights" still counts as asleep,
  so is_sleeping and wake_up's tags behave as vLLM's;
- level 2: the model is dropped (its memory returned to the OS) and read again from its path,
  the latest update's if any, on waking.

Waking the KV pool needs the weights awake (wake "weights" first, or both at once), as the
pool's programs are built over the model.
"""
from __future__ import annotations

import gc
import logging

import torch

from pagewire.wire.engine_control import (KV_CACHE, TAGS, WEIGHTS, ControlDone, EngineControl,
                                          SleepEngine, UpdateWeights, WakeEngine)

from .. import weight_updates
from . import huge_pages

log = logging.getLogger(__name__)
# How asleep weights are held (SleepState.weights)
AWAKE, KEPT, PARKED, DROPPED = "awake", "kept", "parked", "dropped"


class SleepState:
    """The executor's sleep-mode record (runner.sleep)."""

    def __init__(self):
        self.weights = AWAKE
        self.kv_asleep = False
        self.parked: list[tuple[torch.Tensor, torch.Tensor]] = []   # (tensor, host copy)

    def asleep(self) -> list[str]:
        return [t for t, off in zip(TAGS, (self.weights != AWAKE, self.kv_asleep)) if off]


class ControlRefused(ValueError):
    """A control that cannot run as asked (a 400); nothing was changed."""


def run_control(runner, msg: EngineControl) -> ControlDone:
    """Run one control on this rank; the answer (status 400 or 500 with the error, where the
    state is as before)."""
    state = runner.sleep
    try:
        if isinstance(msg, SleepEngine):
            sleep(runner, msg.level)
        elif isinstance(msg, WakeEngine):
            wake(runner, set(msg.tags or TAGS))
        elif isinstance(msg, UpdateWeights):
            update_weights(runner, msg.path)
    except (ControlRefused, weight_updates.WeightsRefused) as e:
        return ControlDone(req_id=msg.req_id, asleep=state.asleep(), status=400, error=str(e))
    except Exception as e:    # a failed load: the old weights (if any) are kept
        log.exception("%s failed", type(msg).__name__)
        return ControlDone(req_id=msg.req_id, asleep=state.asleep(), status=500,
                           error=f"{type(e).__name__}: {e}")
    return ControlDone(req_id=msg.req_id, asleep=state.asleep())


def sleep(runner, level: int) -> None:
    state = runner.sleep
    runner.table.forget_all()
    if not state.kv_asleep:
        runner.drop_kv()
        state.kv_asleep = True
    if level == 2 and state.weights != DROPPED:
        state.parked = []
        runner.drop_weights()
        state.weights = DROPPED
    elif level == 1 and state.weights == AWAKE:
        if runner.backend.capabilities.host_memory:
            state.weights = KEPT
        else:
            state.parked = park(runner.model, pin=True)
            state.weights = PARKED
    release_memory()
    log.info("asleep (level %d): %s", level, ", ".join(state.asleep()))


def wake(runner, tags: set[str]) -> None:
    state = runner.sleep
    if KV_CACHE in tags and state.kv_asleep and state.weights != AWAKE and WEIGHTS not in tags:
        raise ControlRefused("the KV cache is built over the weights: wake the weights first "
                             "(tags=weights, or no tags for both)")
    if WEIGHTS in tags and state.weights != AWAKE:
        if state.weights == PARKED:
            restore(state.parked)
        elif state.weights == DROPPED:
            runner.load_weights(runner.model_info)
        state.parked, state.weights = [], AWAKE
    if KV_CACHE in tags and state.kv_asleep:
        runner.build_kv()
        state.kv_asleep = False
    log.info("awake: %s", ", ".join(sorted(set(TAGS) - set(state.asleep()))) or "nothing")


def update_weights(runner, path: str) -> None:
    """The weights at `path` in the place of the current ones (awake or asleep); the old
    ones keep serving if anything fails before the swap."""
    state = runner.sleep
    info = weight_updates.resolve_update(runner.model_info, path)
    runner.table.forget_all()
    rebuild_kv = not state.kv_asleep
    if rebuild_kv:            # the pool's programs are built over the old model
        runner.drop_kv()
    try:
        runner.load_weights(info)
    finally:
        if rebuild_kv:
            runner.build_kv()
    state.parked, state.weights = [], AWAKE
    release_memory()
    log.info("weights updated from %s", info.path)


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a model holds, once: parameters, buffers, and tensors its modules keep as
    plain attributes, in their lists, tuples and dicts, or in plain objects (a quantized
    linear's blocks), a few levels down."""
    seen: dict[int, torch.Tensor] = {}

    def visit(value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            seen.setdefault(id(value), value)
        elif not depth or isinstance(value, (torch.nn.Module, str, bytes, type)):
            return
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v, depth - 1)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v, depth - 1)
        elif hasattr(value, "__dict__"):
            for v in vars(value).values():
                visit(v, depth - 1)
    for module in model.modules():
        for value in vars(module).values():
            visit(value, 3)
    return list(seen.values())


def park(model: torch.nn.Module, pin: bool, every: bool = False) -> list:
    """Copy each of the model's device tensors (`every`: CPU ones too, for tests) to host
    memory, pinned with `pin`, and release its own memory: the tensor object stays, empty, so
    holders of it see the restored data later. Views taken of a tensor keep their storage
    (not freed). Returns the (tensor, host copy) pairs restore() takes."""
    parked = []
    with torch.no_grad():
        for t in model_tensors(model):
            if (t.is_cpu and not every) or t.numel() == 0:      # host memory already
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t)
            parked.append((t, host))
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return parked


def restore(parked: list) -> None:
    """Each parked tensor's data back on its device (an empty tensor kept its place)."""
    with torch.no_grad():
        for t, host in parked:
            t.data = host.to(t.device)


def release_memory() -> None:
    """Hand what was freed back: Python's cycles, glibc's heap, CUDA's cache."""
    gc.collect()
    huge_pages.release_freed_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
