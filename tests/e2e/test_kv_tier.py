"""The disk KV tier on a real server: blocks are written by the executor process, counted in
/metrics, kept through a stop (SIGTERM) and loaded by the next server on that directory, whose
answer is the first one's."""
from __future__ import annotations

import os
import time

import pytest

from pagewire.testing.server import running_server
from tests.e2e.test_metrics import get
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.slow
PROMPT = list(range(20, 120))          # 100 tokens: 6 full blocks of 16 looked up


def _scrape(srv) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    import urllib.request
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items()
                               if k not in ("model_name", "engine"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _answer(srv) -> list:
    code, reply, _ = srv.request("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": 1})
    assert code == 200, reply
    logprobs = reply["choices"][0]["logprobs"]
    return [logprobs["tokens"], logprobs["token_logprobs"]]


def _eventually(srv, name: str, at_least: float, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = _scrape(srv)
        if get(samples, name) >= at_least or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_a_restarted_server_loads_its_prefix_from_the_tier(tmp_path, smol_tokenizer_dir):
    model = make_tiny_llama(str(tmp_path / "m"), smol_tokenizer_dir, vocab_size=512, seed=3)
    tier = tmp_path / "tier"
    args = [model, "--dtype", "float32", "--served-model-name", "tiny", "--max-model-len", "256",
            "--kv-offload-dir", str(tier), "--kv-offload-size", "64MiB"]
    with running_server(args) as srv:
        first = _answer(srv)
        samples = _eventually(srv, "pagewire:kv_offload_stores_total", 6)
        assert get(samples, "pagewire:kv_offload_stores_total") == 6       # 105 tokens: 6 full
        assert get(samples, "pagewire:kv_offload_blocks") == 6
        assert get(samples, "vllm:external_prefix_cache_hits_total") == 0
        assert srv.stop() == 0
    (directory,) = os.listdir(tier)
    assert len(os.listdir(tier / directory)) == 6      # written before the executor exited
    with running_server(args) as srv:
        second = _answer(srv)
        samples = _eventually(srv, "vllm:external_prefix_cache_hits_total", 96)
        assert get(samples, "vllm:external_prefix_cache_hits_total") == 6 * 16
        assert get(samples, "pagewire:kv_offload_load_failures_total") == 0
    assert second[0] == first[0]
    assert second[1] == pytest.approx(first[1], abs=1e-4)
