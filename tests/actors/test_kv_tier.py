"""The scheduler's side of the disk KV tier: what each plan stores, loads and drops (exact
block ids and hashes), how a sequence waits for its load, and what a failed or aborted load
leaves (the pool whole, the failed hashes forgotten)."""
from __future__ import annotations

from tests.actors.sched_helpers import assert_pool_whole, make_scheduler, new, sid, step

from pagewire.scheduler.kv_manager import block_hashes
from pagewire.scheduler.request import Status
from pagewire.wire.to_executor import KvLoad, TierWork
from pagewire.wire.to_scheduler import StepResult, TierResult


def hashes(first: int, n: int) -> list[bytes]:
    """The chained hashes of the full 4-token blocks of prompt first, first + 1, ..."""
    return block_hashes(list(range(first, first + n)), 4, "kv=auto\x00", [])


def tiered(**options):
    options.setdefault("kv_offload_dir", "/nonexistent")
    options.setdefault("dtype", "float32")     # block bytes below: auto is bfloat16 on some CPUs
    return make_scheduler(num_blocks=8, block_size=4, max_len=32, **options)


def finish_alone(sched, rid: str, n: int, first: int):
    """Run a one-token request to its end, then the plan that stores its last blocks."""
    sched.add(new(rid, n, first=first, max_tokens=1))
    step(sched)
    return step(sched)[0]


def evict_everything(sched) -> None:
    """A 29-token request takes all 8 blocks (evicting what the pool cached)."""
    finish_alone(sched, "big", 29, first=5000)


def asked_again_after_eviction():
    """"a" stored, evicted from the pool, then asked again as "a2": the plan loading it."""
    s = tiered()
    finish_alone(s, "a", 9, first=100)
    evict_everything(s)
    s.add(new("a2", 9, first=100, max_tokens=1))
    return s, s.schedule()


def test_committed_blocks_are_stored_once_by_the_next_plan():
    s = tiered()
    s.add(new("a", 9, first=100, max_tokens=1))
    plan, _ = step(s)
    assert plan.new[0].block_ids == [0, 1, 2] and plan.tier is None   # nothing full yet
    plan, _ = step(s)                 # "a" ended: a plan of its own stores its 2 full blocks
    assert plan.new == plan.running == [] and plan.tier == TierWork([0, 1], hashes(100, 9))
    assert not s.has_work()
    s.add(new("b", 9, first=100, max_tokens=1))   # the same prompt: pool hit, nothing stored
    step(s)
    assert s.schedule() is None
    assert_pool_whole(s)


def test_a_prefix_evicted_from_the_pool_is_loaded_from_the_tier_before_it_runs():
    s, plan = asked_again_after_eviction()
    assert plan.new == [] and plan.tier.loads == [KvLoad(sid("a2"), [0, 1], hashes(100, 9))]
    assert s.seqs[sid("a2")].status is Status.LOADING and not s.waiting
    assert s.schedule() is None       # nothing else to plan until the load's result
    assert s.kv.lookup(hashes(100, 9)) == []          # the pool lost it: "big" evicted it
    s.update(plan, s.run())
    plan, deltas = step(s)
    (seq,) = plan.new
    assert (seq.num_computed, seq.num_scheduled, seq.block_ids) == (8, 1, [0, 1, 7])
    assert deltas[0].finish_reason == "length"
    assert s.tables.tier.hits == 2 and s.tables.external_hits == 8
    assert s.tables.external_queries == 8 + 28 + 8                     # a, big, a2
    assert s.kv.lookup(hashes(100, 9)) == [0, 1]     # loaded blocks join the pool's cache
    assert s.schedule() is None       # and are not stored again
    assert_pool_whole(s)


def test_a_load_that_fails_part_way_computes_the_rest_and_forgets_those_hashes():
    s, plan = asked_again_after_eviction()
    s.update(plan, s.run(result=StepResult(plan.step_id, [], [],
                                           tier=TierResult({sid("a2"): 1}))))
    first, second = hashes(100, 9)
    assert first in s.tables.tier.blocks and second not in s.tables.tier.blocks
    assert (s.tables.tier.hits, s.tables.tier.failures) == (1, 1)
    plan, _ = step(s)
    assert (plan.new[0].num_computed, plan.new[0].num_scheduled) == (4, 5)
    assert second in s.tables.tier.blocks      # computed again, committed: stored again
    step(s)
    assert_pool_whole(s)


def test_a_failed_step_loads_nothing_and_keeps_the_hashes():
    s, plan = asked_again_after_eviction()
    s.update(plan, s.run(result=StepResult(plan.step_id, [], [], error="boom")))
    plan, _ = step(s)
    assert plan.new[0].num_computed == 0
    assert set(hashes(100, 9)) <= set(s.tables.tier.blocks)
    assert s.schedule() is None
    assert_pool_whole(s)


def test_an_abort_while_loading_frees_the_blocks_and_drops_nothing_on_disk():
    s, plan = asked_again_after_eviction()
    deltas = s.abort(["a2"])
    assert [d.finish_reason for d in deltas] == ["abort"] and not s.arrivals.loading
    s.update(plan, s.run())            # the load's result comes for a request that ended
    assert set(hashes(100, 9)) <= set(s.tables.tier.blocks) and s.tables.tier.hits == 2
    assert not s.has_work()
    assert_pool_whole(s)


def test_the_tier_holds_its_capacity_dropping_least_recently_used_hashes():
    # One block of this model's K/V: 4 tokens x 1 layer x 2 x 8 floats of 4 bytes = 256 bytes.
    s = tiered(kv_offload_size=3 * 256)
    assert s.tables.tier.capacity == 3
    finish_alone(s, "a", 9, first=100)                 # stores a's 2 blocks
    plan = finish_alone(s, "b", 9, first=200)          # b's 2: a's first is dropped
    assert plan.tier.store_hashes == hashes(200, 9)
    assert plan.tier.drops == hashes(100, 9)[:1]
    assert list(s.tables.tier.blocks) == hashes(100, 9)[1:] + hashes(200, 9)


def test_a_scheduler_started_over_a_filled_tier_loads_from_it_at_once():
    s = tiered()
    s.core.sched.__init__(s.config, tier_present=hashes(100, 9))   # as after a restart
    s.add(new("a", 13, first=100, max_tokens=1))
    plan = s.schedule()
    assert plan.tier.loads == [KvLoad(sid("a"), [0, 1], hashes(100, 9))]
    s.update(plan, s.run())
    plan, _ = step(s)
    assert (plan.new[0].num_computed, plan.new[0].num_scheduled) == (8, 5)


def test_tier_counters_reach_the_metrics_in_blocks_tokens_and_bytes():
    from pagewire.gateway.metrics import GatewayMetrics
    from pagewire.scheduler.actor import StatsReporter
    from tests.actors.test_metrics import VLLM, parse, value
    s, plan = asked_again_after_eviction()
    s.update(plan, s.run(result=StepResult(plan.step_id, [], [],
                                           tier=TierResult({sid("a2"): 1}))))
    sent = []
    StatsReporter(s.core.sched, sent.append).report(0.0)
    m = GatewayMetrics("tiny")
    m.on_scheduler_stats(sent[0])
    got = parse(m.exposition().decode())
    assert value(got, "vllm:external_prefix_cache_queries_total", **VLLM) == 8 + 28 + 8
    assert value(got, "vllm:external_prefix_cache_hits_total", **VLLM) == 4
    assert value(got, "pagewire:kv_offload_stores_total", **VLLM) == 2 + 7
    assert value(got, "pagewire:kv_offload_loads_total", **VLLM) == 2
    assert value(got, "pagewire:kv_offload_load_failures_total", **VLLM) == 1
    assert value(got, "pagewire:kv_offload_stored_bytes_total", **VLLM) == 9 * 256
    assert value(got, "pagewire:kv_offload_loaded_bytes_total", **VLLM) == 256
    assert value(got, "pagewire:kv_offload_blocks", **VLLM) == 8     # the failed one forgotten
