"""GET /metrics on a real `pagewire serve` (with n-gram speculation on): vLLM's counters agree
with the usage the openai client got back, a stream cancelled mid-way leaves nothing running
and no KV blocks held, and the drafts' counters move when the answer copies the prompt."""
from __future__ import annotations

import tempfile
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagewire.testing.server import Server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
LABELS = {"model_name": MODEL}


@pytest.fixture(scope="module")
def server():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_parent:
        srv = Server(["--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                      "--kv-cache-dtype", "int8",
                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "max_batch": 8}'],
                     run_parent)
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value; vllm:* samples keyed without model_name/engine."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("vllm:"):
                assert labels.pop("model_name") == MODEL
                labels.pop("engine", None)
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def get(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def successes(samples) -> float:
    return sum(v for (name, _), v in samples.items() if name == "vllm:request_success_total")


def poll(server, done, timeout: float = 5.0):
    """Scrape until done(samples) holds (scheduler figures arrive up to a second late)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_counters_match_usage(server, client):
    before = scrape(server)
    usages, reasons = [], []
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": "Name a colour."}])
    usages.append(r.usage)
    reasons.append(r.choices[0].finish_reason)
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  temperature=0, max_tokens=8)
    usages.append(r.usage)
    reasons.append(r.choices[0].finish_reason)
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0,
                                            max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    reasons.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)

    def delta(samples, name, **labels):
        return get(samples, name, **labels) - get(before, name, **labels)

    after = poll(server, lambda s: delta(s, "vllm:generation_tokens_total") >= generated)
    assert successes(after) - successes(before) == 3
    for reason in set(reasons):
        assert delta(after, "vllm:request_success_total", finished_reason=reason) == \
            reasons.count(reason)
    assert delta(after, "vllm:generation_tokens_total") == generated
    assert delta(after, "vllm:prompt_tokens_total") == prompt
    assert delta(after, "vllm:time_to_first_token_seconds_count") == 3
    assert delta(after, "vllm:e2e_request_latency_seconds_count") == 3
    assert delta(after, "vllm:request_prompt_tokens_sum") == prompt
    assert delta(after, "vllm:request_generation_tokens_sum") == generated
    assert delta(after, "vllm:inter_token_latency_seconds_count") == generated - 3
    assert delta(after, "vllm:request_queue_time_seconds_count") == 3
    assert delta(after, "vllm:iteration_tokens_total_sum") >= generated
    assert delta(after, "pagewire:step_duration_seconds_count") == \
        delta(after, "vllm:iteration_tokens_total_count") > 0
    assert delta(after, "pagewire:scheduler_inbox_messages_total", type="NewRequest") == 3
    assert get(after, "vllm:num_requests_running") == 0
    assert get(after, "pagewire:requests_in_flight") == 0


def test_cancelled_stream_frees_everything(server, client):
    before = scrape(server)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=900,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 1:
            break
    busy = poll(server, lambda s: get(s, "vllm:num_requests_running") == 1)
    assert get(busy, "vllm:num_requests_running") == 1
    assert get(busy, "vllm:kv_cache_usage_perc") > 0
    assert get(busy, "pagewire:requests_in_flight") == 1
    stream.close()

    def aborts(samples):
        return get(samples, "pagewire:scheduler_inbox_messages_total", type="Abort")

    after = poll(server, lambda s: aborts(s) > aborts(before)
                 and get(s, "vllm:num_requests_running") == 0
                 and get(s, "vllm:kv_cache_usage_perc") == 0)
    assert aborts(after) > aborts(before)
    assert get(after, "vllm:num_requests_running") == 0
    assert get(after, "vllm:num_requests_waiting") == 0
    assert get(after, "vllm:kv_cache_usage_perc") == 0
    assert get(after, "vllm:request_success_total", finished_reason="abort") - \
        get(before, "vllm:request_success_total", finished_reason="abort") == 1
    assert get(after, "pagewire:requests_in_flight") == 0


def test_backend_is_the_one_executor_0_runs(server):
    """The default server on this CPU runs its best native tier, float32 unless that tier
    multiplies bfloat16 in hardware; /metrics says so."""
    from pagewire.kernels import tiers
    tier = tiers.best()
    backend, dtype = (f"cpu-{tier}", "bfloat16" if tiers.has_bf16_dot(tier) else "float32") \
        if tier else ("torch", "float32")
    samples = scrape(server)
    assert get(samples, "pagewire:backend_info", backend=backend, dtype=dtype) == 1
    assert [k for k in samples if k[0] == "pagewire:backend_info"] == \
        [("pagewire:backend_info", frozenset({"backend": backend, "dtype": dtype}.items()))]


def test_cache_config_info_shows_the_kv_cache(server):
    """vLLM's cache_config_info: the default model's 30 layers x 3 kv heads x (keys, values)
    of 64 int8 codes and a 4-byte scale, 16 tokens a block, in 256 MiB."""
    keys = [k for k in scrape(server) if k[0] == "vllm:cache_config_info"]
    assert len(keys) == 1
    labels = dict(keys[0][1])
    assert labels["cache_dtype"] == "int8" and labels["block_size"] == "16"
    assert labels["num_gpu_blocks"] == str(256 * 2**20 // (16 * 2 * 30 * 3 * 68)) == "1370"
    assert labels["enable_prefix_caching"] == "True" and labels["num_cpu_blocks"] == "0"


def test_speculative_decoding_counters(server, client):
    before = scrape(server)
    text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    r = client.completions.create(model=MODEL, prompt=f"{text}\n{text}\n{text}\n",
                                  max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24

    def delta(samples, name):
        return get(samples, name) - get(before, name)

    after = poll(server, lambda s: delta(s, "vllm:spec_decode_num_accepted_tokens_total") > 0)
    drafts = delta(after, "vllm:spec_decode_num_draft_tokens_total")
    accepted = delta(after, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafts
    assert delta(after, "vllm:spec_decode_num_drafts_total") > 0
    assert get(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") >= \
        get(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2")
