"""Metrics: the gateway's registry fed by hand (exact values in the exposition text), the
scheduler's counters on a hand-driven Scheduler, the scheduler actor's report/log cadence on a
fake clock, and /metrics on a real Gateway app (API key option, SchedulerStats routed by pump)."""
from __future__ import annotations

import asyncio
import logging
import tempfile
from unittest import mock

import msgspec
import pytest
import zmq
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from pagewire.config import EngineConfig
from pagewire.gateway.metrics import GatewayMetrics, buckets_1_2_5
from pagewire.scheduler.actor import StatsReporter
from pagewire.wire.channels import PushChannel, ipc_address
from pagewire.wire.to_gateway import SchedulerStats, TextDelta
from pagewire.wire.to_scheduler import StepResult
from tests.actors.sched_helpers import EOS, ids, make_scheduler, new, step


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """sample name -> [(labels, value)]"""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples, name: str, **labels) -> float:
    matches = [v for lab, v in samples[name] if all(lab.get(k) == w for k, w in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


VLLM = {"model_name": "tiny", "engine": "0"}


def stats(**kw) -> SchedulerStats:
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, prompt_tokens=0,
                generation_tokens=0, preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)
    return SchedulerStats(**{**base, **kw})


# -- the gateway's registry ------------------------------------------------------------------

def test_request_histograms_and_finish_reasons():
    m = GatewayMetrics("tiny", max_model_len=64, max_num_batched_tokens=32)
    m.on_request_start(["r-0", "r-0.1"], now=10.0)       # one request, n=2
    assert value(parse(m.exposition().decode()), "pagewire:requests_in_flight") == 1
    m.on_tokens(TextDelta("r-0", "a", 5, 1), now=10.5)             # TTFT 0.5
    m.on_tokens(TextDelta("r-0.1", "x", 5, 1), now=10.75)          # TTFT 0.75
    m.on_tokens(TextDelta("r-0", "b", 5, 2), now=10.75)            # ITL 0.25
    m.on_tokens(TextDelta("r-0", "", 5, 2), now=10.8)              # no new token: nothing
    m.on_tokens(TextDelta("r-0", "cd", 5, 4, "stop"), now=11.25)   # ITL 0.5, finished
    m.on_tokens(TextDelta("other", "z", 3, 1), now=11.0)           # not tracked: ignored
    m.on_request_end(["r-0", "r-0.1"], {"r-0.1"}, now=12.0)        # r-0.1 aborted (client gone)
    # A request refused by the scheduler (queue full) and one refused by a tokenizer.
    m.on_request_start(["q-0"], now=20.0)
    m.on_tokens(TextDelta("q-0", "", 3, 0, "rejected"), now=20.1)
    m.on_request_end(["q-0"], set(), now=20.2)
    m.on_request_start(["f-0"], now=30.0)
    m.on_request_end(["f-0"], set(), now=30.1)
    # Aborted before any reply: counted, prompt length unknown.
    m.on_request_start(["g-0"], now=40.0)
    m.on_request_end(["g-0"], {"g-0"}, now=40.5)

    s = parse(m.exposition().decode())
    assert value(s, "pagewire:requests_in_flight") == 0
    assert value(s, "vllm:time_to_first_token_seconds_count", **VLLM) == 2
    assert value(s, "vllm:time_to_first_token_seconds_sum", **VLLM) == pytest.approx(1.25)
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="0.5", **VLLM) == 1
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="0.75", **VLLM) == 2
    assert value(s, "vllm:inter_token_latency_seconds_count", **VLLM) == 2
    assert value(s, "vllm:inter_token_latency_seconds_sum", **VLLM) == pytest.approx(0.75)
    assert value(s, "vllm:e2e_request_latency_seconds_count", **VLLM) == 3
    assert value(s, "vllm:e2e_request_latency_seconds_sum", **VLLM) == pytest.approx(1.25 + 2 + 0.5)
    assert value(s, "vllm:request_prompt_tokens_count", **VLLM) == 2
    assert value(s, "vllm:request_prompt_tokens_sum", **VLLM) == 10
    assert value(s, "vllm:request_generation_tokens_count", **VLLM) == 3
    assert value(s, "vllm:request_generation_tokens_sum", **VLLM) == 5
    assert value(s, "vllm:request_generation_tokens_bucket", le="1.0", **VLLM) == 2
    assert value(s, "vllm:request_success_total", finished_reason="stop", **VLLM) == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort", **VLLM) == 2
    assert value(s, "vllm:request_success_total", finished_reason="length", **VLLM) == 0
    assert value(s, "vllm:request_success_total", finished_reason="error", **VLLM) == 0
    assert len(s["vllm:request_success_total"]) == 4
    assert not m.seqs                                  # nothing left tracked


def test_error_finish_and_buckets():
    m = GatewayMetrics("tiny", max_model_len=64)
    m.on_request_start(["e-0"], now=0.0)
    m.on_tokens(TextDelta("e-0", "", 7, 0, "error", "boom"), now=0.5)
    m.on_request_end(["e-0"], {"e-0"}, now=1.0)        # finished already: not an abort too
    s = parse(m.exposition().decode())
    assert value(s, "vllm:request_success_total", finished_reason="error", **VLLM) == 1
    assert sum(v for _, v in s["vllm:request_success_total"]) == 1
    assert value(s, "vllm:time_to_first_token_seconds_count", **VLLM) == 0
    assert buckets_1_2_5(64) == [1, 2, 5, 10, 20, 50]
    les = [lab["le"] for lab, _ in s["vllm:request_prompt_tokens_bucket"]]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]


def test_scheduler_stats_feed_counters_gauges_and_histograms():
    m = GatewayMetrics("tiny", max_model_len=64, max_num_batched_tokens=32)
    m.on_scheduler_stats(stats(
        num_running=3, num_waiting=2, kv_cache_usage=0.25, prompt_tokens=10, generation_tokens=4,
        preemptions=1, prefix_cache_queries=32, prefix_cache_hits=16,
        inbox_messages={"NewRequest": 2, "StepResult": 3}, iteration_tokens=[10, 2],
        queue_times=[0.01], step_durations=[0.002, 0.004]))
    m.on_scheduler_stats(stats(                 # counters cumulative, lists since the last one
        num_running=0, num_waiting=0, kv_cache_usage=0.0, prompt_tokens=15, generation_tokens=9,
        preemptions=1, prefix_cache_queries=40, prefix_cache_hits=16,
        inbox_messages={"NewRequest": 3, "StepResult": 8, "Abort": 1},
        iteration_tokens=[5, 1, 1, 1, 1], queue_times=[0.02], step_durations=[0.001]))
    s = parse(m.exposition().decode())
    assert value(s, "vllm:num_requests_running", **VLLM) == 0
    assert value(s, "vllm:num_requests_waiting", **VLLM) == 0
    assert value(s, "vllm:kv_cache_usage_perc", **VLLM) == 0
    assert value(s, "vllm:prompt_tokens_total", **VLLM) == 15
    assert value(s, "vllm:generation_tokens_total", **VLLM) == 9
    assert value(s, "vllm:num_preemptions_total", **VLLM) == 1
    assert value(s, "vllm:prefix_cache_queries_total", **VLLM) == 40
    assert value(s, "vllm:prefix_cache_hits_total", **VLLM) == 16
    assert value(s, "vllm:iteration_tokens_total_count", **VLLM) == 7
    assert value(s, "vllm:iteration_tokens_total_sum", **VLLM) == 21
    assert value(s, "vllm:iteration_tokens_total_bucket", le="1.0", **VLLM) == 4
    assert value(s, "vllm:iteration_tokens_total_bucket", le="8.0", **VLLM) == 6
    assert [lab["le"] for lab, _ in s["vllm:iteration_tokens_total_bucket"]] == \
        ["1.0", "8.0", "16.0", "32.0", "+Inf"]
    assert value(s, "vllm:request_queue_time_seconds_count", **VLLM) == 2
    assert value(s, "vllm:request_queue_time_seconds_sum", **VLLM) == pytest.approx(0.03)
    assert value(s, "pagewire:step_duration_seconds_count") == 3
    assert value(s, "pagewire:step_duration_seconds_sum") == pytest.approx(0.007)
    assert value(s, "pagewire:scheduler_inbox_messages_total", type="NewRequest") == 3
    assert value(s, "pagewire:scheduler_inbox_messages_total", type="StepResult") == 8
    assert value(s, "pagewire:scheduler_inbox_messages_total", type="Abort") == 1


def test_every_vllm_metric_has_the_model_name_label():
    m = GatewayMetrics("tiny")
    for family in text_string_to_metric_families(m.exposition().decode()):
        if family.name.startswith("vllm:"):
            assert family.samples, family.name
            assert all(s.labels["model_name"] == "tiny" for s in family.samples), family.name


# -- the scheduler's counters ----------------------------------------------------------------

def test_scheduler_counts_prompt_and_generation_tokens_and_prefix_hits():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=4)
    sched.add(new("a", 6, first=100, max_tokens=3))
    step(sched)                                 # a: prompt chunk of 4 (budget 4): not counted yet
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (0, 0)
    assert sched.first_scheduled == [0.0]
    step(sched)                                 # the last 2 prompt tokens, first sample
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (6, 1)
    assert sched.first_scheduled == []          # a was scheduled before
    assert sched.kv_cache_usage() == 2 / 16
    step(sched)
    step(sched)                                 # third token: length
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (6, 3)
    assert not sched.has_work() and sched.kv_cache_usage() == 0.0
    assert (sched.tables.prefix_queries, sched.tables.prefix_hits) == (6, 0)
    # Same prompt again: its first block is cached. The prompt counts whole (vLLM's count).
    sched.add(new("b", 6, first=100, max_tokens=1, stop_token_ids=[EOS]))
    step(sched)
    assert (sched.tables.prefix_queries, sched.tables.prefix_hits) == (12, 4)
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (12, 4)
    assert sched.num_preemptions == 0


def test_scheduler_counts_a_forked_prompt_once():
    sched = make_scheduler()
    sched.add(new("c", 5, n=3, max_tokens=2))
    step(sched)                                 # prompt minus its last token, then the fork
    assert sched.num_prompt_tokens == 5
    step(sched)                                 # each sequence: the last prompt token, a sample
    step(sched)
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (5, 6)
    assert not sched.has_work()
    sched.add(new("d", 1, n=2, max_tokens=1))   # a one-token prompt forks on arrival
    step(sched)
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (6, 8)


def test_scheduler_preemption_does_not_recount_prompt_or_queue_time():
    sched = make_scheduler(num_blocks=4, block_size=4, max_len=16)
    sched.add(new("a", 7, max_tokens=20))
    sched.add(new("b", 7, max_tokens=20))
    step(sched)
    assert sched.first_scheduled == [0.0, 0.0]
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (14, 2)
    step(sched, default=6)
    plan = sched.schedule()                     # a needs a block: b is preempted
    assert sched.num_preemptions == 1 and sched.first_scheduled == []
    sched.update(plan, StepResult(plan.step_id, ids("a"), [7]))
    sched.abort(["a"])
    plan = sched.schedule()                     # b recomputes its prompt and outputs
    assert [str(s.seq_id) for s in plan.new] == ["b"] and sched.first_scheduled == []
    sched.update(plan, StepResult(plan.step_id, ids("b"), [7]))
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (14, 6)
    sched.abort(["b"])


# -- the scheduler actor's reports and log line ----------------------------------------------

class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_reports_once_a_second_while_busy_and_once_on_idle(caplog):
    sched = make_scheduler(num_blocks=16, block_size=4)
    clock, sent = FakeClock(), []
    rep = StatsReporter(sched, sent.append, clock=clock, wall_clock=lambda: 1000.0)
    msg = msgspec.structs.replace(new("a", 6, max_tokens=3), arrival_time=999.5)
    clock.t = 101.0                             # activity starts: the log interval from here
    rep.on_message(msg)
    sched.add(msg)
    steps = 0

    def run_step(seconds: float):
        nonlocal steps
        plan = sched.schedule()
        rep.on_plan(plan)
        clock.t += seconds
        rep.on_result()
        rep.on_message(StepResult(plan.step_id, [], []))
        sched.update(plan, sched.run())
        steps += 1
        return rep.tick(sched.has_work())

    assert run_step(0.25) == pytest.approx(1.0)    # over a second since the last report
    (first,) = sent
    assert (first.num_running, first.prompt_tokens, first.generation_tokens) == (1, 6, 1)
    assert first.iteration_tokens == [6] and first.queue_times == [0.5]
    assert first.step_durations == [0.25]
    assert first.inbox_messages == {"NewRequest": 1, "StepResult": 1}
    assert first.kv_cache_usage == 2 / 16
    assert run_step(0.5) == pytest.approx(0.5)     # no report within the second
    assert len(sent) == 1
    wait = run_step(0.25)                          # the last token: idle, reported at once
    assert len(sent) == 2
    idle = sent[1]
    assert (idle.num_running, idle.num_waiting, idle.kv_cache_usage) == (0, 0, 0.0)
    assert (idle.prompt_tokens, idle.generation_tokens) == (6, 3)
    assert idle.iteration_tokens == [1, 1] and idle.queue_times == []
    assert idle.step_durations == [0.5, 0.25]
    assert idle.inbox_messages == {"NewRequest": 1, "StepResult": 3}
    assert wait == pytest.approx(2.0)              # idle: the next heartbeat is due first
    clock.t += wait
    assert rep.tick(False) == pytest.approx(2.0)   # heartbeat sent; the log line is due next
    assert len(sent) == 3 and sent[2].num_running == 0 and sent[2].step_durations == []
    clock.t += 2.0
    with caplog.at_level(logging.INFO, logger="pagewire.scheduler.actor"):
        assert rep.tick(False) == pytest.approx(2.0)   # logged; only heartbeats from here
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("Avg prompt throughput: 1.2 tokens/s, Avg generation throughput: 0.6 tokens/s, "
                    "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
                    "Prefix cache hit rate: 0.0%")
    assert len(sent) == 4
    # A long quiet spell does not dilute the next interval's throughput.
    clock.t += 3600
    caplog.clear()
    rep.on_message(new("b", 9, max_tokens=1))
    sched.add(new("b", 9, max_tokens=1))
    with caplog.at_level(logging.INFO, logger="pagewire.scheduler.actor"):
        run_step(0.5)
        clock.t += 4.5
        assert rep.tick(False) == pytest.approx(2.0)   # logged; heartbeats only from here
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("Avg prompt throughput: 1.8 tokens/s, Avg generation throughput: 0.2 ")


# -- /metrics on a real Gateway app ----------------------------------------------------------

def _gateway(run_dir: str, **options):
    from pagewire.gateway.server import Gateway
    info = make_scheduler().config.model.model_info
    config = EngineConfig.from_options(model_info=info, num_kv_blocks=16, block_size=4,
                                       run_dir=run_dir, served_model_name="tiny",
                                       **options).resolve()
    return Gateway(config, lambda name: ipc_address(run_dir, name)), config


async def _get_metrics(client, headers=None):
    r = await client.get("/metrics", headers=headers or {})
    return r.status, r.headers.get("Content-Type", ""), await r.text()


def test_metrics_endpoint_is_open_by_default_and_routes_scheduler_stats():
    async def main():
        with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
            gateway, _ = _gateway(run_dir, api_keys=["secret"])
            pump = asyncio.get_running_loop().create_task(gateway.pump())
            ctx = zmq.Context()
            push = PushChannel(ctx, ipc_address(run_dir, "gateway"))
            push.send(stats(num_running=2, kv_cache_usage=0.5, generation_tokens=7))
            async with TestClient(TestServer(gateway.app)) as client:
                for _ in range(200):
                    status, ctype, text = await _get_metrics(client)
                    if value(parse(text), "vllm:generation_tokens_total", **VLLM) == 7:
                        break
                    await asyncio.sleep(0.01)
                assert status == 200 and ctype.startswith("text/plain")
                s = parse(text)
                assert value(s, "vllm:generation_tokens_total", **VLLM) == 7
                assert value(s, "vllm:num_requests_running", **VLLM) == 2
                assert value(s, "vllm:kv_cache_usage_perc", **VLLM) == 0.5
                assert (await client.get("/v1/models")).status == 401   # /v1 still guarded
            pump.cancel()
            push.close()
            ctx.term()
    asyncio.run(main())


def test_metrics_require_api_key_option():
    async def main():
        with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
            gateway, config = _gateway(run_dir, api_keys=["secret"], metrics_require_api_key=True)
            async with TestClient(TestServer(gateway.app)) as client:
                assert (await _get_metrics(client))[0] == 401
                assert (await _get_metrics(client, {"Authorization": "Bearer nope"}))[0] == 401
                status, _, text = await _get_metrics(client, {"Authorization": "Bearer secret"})
                assert status == 200 and "vllm:num_requests_running" in text
    asyncio.run(main())


def test_cli_flag_sets_the_option():
    from pagewire import cli

    class Stop(Exception):
        pass

    with mock.patch.object(cli, "config_from_args", side_effect=Stop) as config:
        with pytest.raises(Stop):
            cli.main(["serve", "--metrics-require-api-key"])
    assert cli.config_from_args(config.call_args.args[0]).server.metrics_require_api_key is True
    assert EngineConfig().server.metrics_require_api_key is False


def test_health_follows_the_engine_heartbeat():
    async def main():
        with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
            gateway, _ = _gateway(run_dir)
            async with TestClient(TestServer(gateway.app)) as client:
                assert (await client.get("/health")).status == 200
                gateway.heard_from_engine -= 11            # no heartbeat for 11 s
                r = await client.get("/health")
                assert (r.status, (await r.json())["status"]) == (503, "engine not responding")
                gateway.heard_from_engine += 11
                gateway.step_running_for = 61.0            # one step for over a minute
                r = await client.get("/health")
                assert r.status == 503 and "stalled" in (await r.json())["status"]
                gateway.step_running_for, gateway.draining = 0.0, True
                r = await client.get("/health")
                assert (r.status, (await r.json())["status"]) == (503, "draining")
    asyncio.run(main())
