"""Disaggregated prefill and decode on real servers: `pagewire router` in front of a prefill
engine and a decode engine (tiny model, one core each) answers with one engine's greedy
tokens, streamed or not, the decode engine's prompt blocks pulled from the prefill engine;
both pools end whole; a decode engine that cannot be reached is passed over; with the
prefill engine stopped, requests are still answered."""
from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest

from pagewire.testing.server import Router, free_port, running_server
from tests.e2e.test_kv_tier import _scrape
from tests.e2e.test_metrics import get
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.slow
PROMPT = list(range(30, 130))            # 100 tokens: 6 full blocks of 16 pulled


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _tokens(base: str, stream: bool = False) -> list[str]:
    code, raw = _post(base + "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
        "stream": stream})
    assert code == 200, raw
    if not stream:
        return json.loads(raw)["choices"][0]["logprobs"]["tokens"]
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    return [t for e in events for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]


def test_router_prefill_and_decode_engines_give_one_engines_tokens(tmp_path, smol_tokenizer_dir):
    model = make_tiny_llama(str(tmp_path / "m"), smol_tokenizer_dir, vocab_size=512, seed=4)
    common = [model, "--dtype", "float32", "--served-model-name", "tiny", "--max-model-len",
              "256", "--threads", "1"]
    kv_port = free_port()
    producer = common + ["--kv-transfer-config",
                         json.dumps({"kv_role": "kv_producer", "kv_port": kv_port})]
    consumer = common + ["--kv-transfer-config", json.dumps(
        {"kv_role": "kv_consumer", "kv_connector_extra_config": {"pull_timeout": 1}})]
    gone = f"http://127.0.0.1:{free_port()}"       # a decode engine that is not there
    with running_server(producer) as p, running_server(consumer) as d:
        expected = _tokens(p.url)                  # one engine, alone (no transfer asked)
        router = Router(p.url, gone, d.url, healthy_enough=True)
        try:
            assert _tokens(router.url) == expected
            assert _tokens(router.url, stream=True) == expected
            samples = _scrape(d)   # the second found the prefix in the decode engine's pool
            assert get(samples, "vllm:external_prefix_cache_hits_total") == 6 * 16
            assert get(samples, "vllm:prefix_cache_hits_total") == 6 * 16
            time.sleep(2.5)                 # the releases reach the prefill engine's scheduler,
            assert get(_scrape(p), "vllm:kv_cache_usage_perc") == 0.0   # and its report
            assert get(_scrape(d), "vllm:kv_cache_usage_perc") == 0.0
            other = list(range(200, 300))   # not in the decode engine's pool
            code, raw = _post(p.url + "/v1/completions", {        # prefilled, then killed
                "model": "tiny", "prompt": other, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}})
            params = json.loads(raw)["kv_transfer_params"]
            p.stop(signal.SIGKILL)          # before its blocks are pulled: decode computes
            code, raw = _post(d.url + "/v1/completions", {
                "model": "tiny", "prompt": other, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "kv_transfer_params": params})
            assert code == 200 and json.loads(raw)["usage"]["completion_tokens"] == 8
            assert get(_scrape(d), "vllm:external_prefix_cache_hits_total") == 6 * 16
            assert _tokens(router.url) == expected       # the router: prefill unreachable
            code, raw = _post(d.url + "/v1/completions", {       # a bad transfer: a 400
                "model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "x"}})
            assert code == 400 and b"remote_port" in raw
        finally:
            router.stop()
