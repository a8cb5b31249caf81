"""The front's rules for loading and unloading models, on engines that start no process."""
from __future__ import annotations

import asyncio
import time

import pytest

from pagewire.config_sections import FleetConfig
from pagewire.front.fleet import Fleet, FleetError
from pagewire.front.model_engine import ModelEngine
from pagewire.front.models_file import ModelEntry

GIB = 2**30


class FakeEngine(ModelEngine):
    """Loads and unloads at once (or when `gate` opens), logging each in `events`."""
    events: list = []
    failing: set = set()
    raising: set = set()
    stalled: dict = {}
    gate: asyncio.Event | None = None

    async def load(self, front_values, config_dir, timeout):
        self.set_state("loading")
        if FakeEngine.gate is not None:
            await FakeEngine.gate.wait()
        if self.name in FakeEngine.failing:
            self.set_state("failed", "its engine exited with code 1")
            return
        if self.name in FakeEngine.raising:
            raise OSError("disk gone")
        self.loads += 1
        self.last_used = time.monotonic()
        FakeEngine.events.append(("load", self.name))
        self.set_state("loaded")

    async def hung(self):
        return FakeEngine.stalled.get(self.name)

    async def unload(self, drain_timeout, reason):
        FakeEngine.events.append(("unload", self.name))
        self.set_state("unloaded", reason)


def _fleet(**options) -> Fleet:
    FakeEngine.events, FakeEngine.failing, FakeEngine.gate = [], set(), None
    FakeEngine.raising, FakeEngine.stalled = set(), {}
    entries = [ModelEntry("a", "/m/a", pinned=True, memory=GIB)] + \
        [ModelEntry(n, f"/m/{n}", memory=GIB) for n in "bcd"]
    return Fleet(entries, FleetConfig(**options), {}, "/nonexistent", 1.0,
                 make_engine=FakeEngine)


async def _use(fleet: Fleet, name: str) -> None:
    engine = fleet.engines[name]
    await fleet.acquire(engine)
    fleet.release(engine)


def test_past_the_memory_budget_the_least_recently_used_idle_model_unloads():
    async def main():
        fleet = _fleet(models_memory_budget=int(3.5 * GIB))
        await fleet.start()
        for name in "bcb":                   # c is now the least recently used
            await _use(fleet, name)
        await _use(fleet, "d")
        return fleet
    fleet = asyncio.run(main())
    assert FakeEngine.events == [("load", "a"), ("load", "b"), ("load", "c"),
                                 ("unload", "c"), ("load", "d")]
    assert {n: e.state for n, e in fleet.engines.items()} == {
        "a": "loaded", "b": "loaded", "c": "unloaded", "d": "loaded"}
    assert fleet.engines["c"].reason == "unloaded to make room for 'd' (least recently used)"


def test_pinned_and_busy_models_are_never_unloaded_for_room():
    async def main():
        fleet = _fleet(models_memory_budget=int(2.5 * GIB))
        await fleet.start()
        await fleet.acquire(fleet.engines["b"])          # in flight: not idle
        with pytest.raises(FleetError) as e:
            await fleet.acquire(fleet.engines["c"])
        return fleet, e.value
    fleet, error = asyncio.run(main())
    assert error.status == 503 and "could not be loaded: no room: 2 models hold 2048 MiB" \
        in str(error)
    assert FakeEngine.events == [("load", "a"), ("load", "b")]
    assert fleet.engines["c"].state == "failed"


def test_max_loaded_models_and_a_model_bigger_than_the_budget():
    async def main():
        fleet = _fleet(max_loaded_models=2)
        await fleet.start()
        for name in "bc":
            await _use(fleet, name)
        small = _fleet(models_memory_budget=GIB // 2)
        with pytest.raises(FleetError) as e:
            await _use(small, "b")
        return e.value
    error = asyncio.run(main())
    assert "more than the whole --models-memory-budget (512 MiB)" in str(error)


def test_a_failed_load_answers_its_waiters_and_the_next_request_tries_again():
    async def main():
        fleet = _fleet()
        FakeEngine.failing = {"b"}
        FakeEngine.gate = asyncio.Event()
        waiters = [asyncio.create_task(_use(fleet, "b")) for _ in range(3)]
        await asyncio.sleep(0.01)
        FakeEngine.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        FakeEngine.failing = set()
        await _use(fleet, "b")
        return fleet, results
    fleet, results = asyncio.run(main())
    assert [str(r) for r in results] == \
        ["model 'b' could not be loaded: its engine exited with code 1"] * 3
    assert fleet.engines["b"].state == "loaded" and fleet.engines["b"].loads == 1


def test_a_load_that_raises_fails_its_waiters_and_never_hangs_them():
    async def main():
        fleet = _fleet(model_load_timeout=5)
        FakeEngine.raising = {"d"}
        with pytest.raises(FleetError) as e:
            await _use(fleet, "d")
        return e.value
    assert str(asyncio.run(main())) == "model 'd' could not be loaded: OSError: disk gone"


def test_requests_waiting_on_a_load_are_bounded_and_time_out():
    async def main():
        fleet = _fleet(model_queue_size=1, model_load_timeout=0.2)
        FakeEngine.gate = asyncio.Event()
        first = asyncio.create_task(_use(fleet, "b"))
        await asyncio.sleep(0.01)
        with pytest.raises(FleetError) as over:
            await _use(fleet, "b")
        with pytest.raises(FleetError) as late:
            await first
        FakeEngine.gate.set()
        await _use(fleet, "b")              # the load went on: loaded now
        return over.value, late.value
    over, late = asyncio.run(main())
    assert "1 requests already wait for it" in str(over)
    assert str(late) == "model 'b' is still loading after 0s; retry later"


def test_an_idle_model_unloads_and_a_pinned_one_stays():
    async def main():
        fleet = _fleet(model_idle_timeout=0.1)
        await fleet.start()
        await _use(fleet, "b")
        keeper = asyncio.create_task(fleet.housekeeping())
        await asyncio.sleep(0.8)
        keeper.cancel()
        return fleet
    fleet = asyncio.run(main())
    assert fleet.engines["a"].state == "loaded"
    assert (fleet.engines["b"].state, fleet.engines["b"].reason) == ("unloaded", "idle for 0.1s")


def test_a_hung_engine_is_unloaded_and_the_others_serve_on():
    async def main():
        fleet = _fleet()
        await fleet.start()
        await _use(fleet, "b")
        FakeEngine.stalled = {"b": "engine step stalled for 61s"}
        await fleet.restart_hung()
        await asyncio.sleep(0.01)
        return fleet
    fleet = asyncio.run(main())
    assert (fleet.engines["a"].state, fleet.engines["b"].state) == ("loaded", "unloaded")
    assert fleet.engines["b"].reason == "unloaded: engine step stalled for 61s"
