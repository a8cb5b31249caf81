"""Several models behind one endpoint (`pagewire serve --models-file`), with real engines:
three tiny models, one pinned; a model loads on its first request and answers with its own
weights' greedy tokens; a killed executor of one model leaves the others answering; the
memory budget unloads the least recently used; a model idle past its timeout unloads; an
unload lets the request in flight finish; unknown names and paths are refused."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.request

import pytest
import torch

from pagewire.testing.server import Server, alive, child_pids, cmdline
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.slow
PROMPT = [1, 17, 42, 99, 7]
MODELS = """
[models.alpha]
model = "a"
pinned = true
memory = "1GiB"

[models.beta]
model = "b"
memory = "1GiB"

[models.gamma]
model = "c"
memory = "1GiB"
idle_timeout = 2
"""


def greedy(path: str, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def front(tmp_path_factory, smol_tokenizer_dir):
    root = tmp_path_factory.mktemp("front")
    paths = {n: make_tiny_llama(str(root / n), smol_tokenizer_dir, seed=i)
             for i, n in enumerate("abc")}
    (root / "models.toml").write_text(MODELS)
    server = Server(["--models-file", str(root / "models.toml"), "--models-memory-budget",
                     "2.5GiB", "--max-model-len", "256", "--kv-cache-memory", "16MiB"],
                    str(root))
    server.paths = paths
    yield server
    assert server.stop() == 0
    assert not [p for p in child_pids(server.proc.pid) if alive(p)]


def complete(server, model: str, max_tokens: int = 6, **extra) -> tuple[int, dict]:
    status, body, _ = server.request("POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True, **extra})
    return status, body


def tokens(body: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def states(server) -> dict[str, str]:
    _, body, _ = server.request("GET", "/v1/models")
    return {m["id"]: m["status"]["value"] for m in body["data"]}


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_model_loads_on_its_first_request_and_answers_with_its_own_weights(front):
    assert states(front) == {"alpha": "loaded", "beta": "unloaded", "gamma": "unloaded"}
    status, body = complete(front, "beta")
    assert status == 200 and body["model"] == "beta"
    assert tokens(body) == greedy(front.paths["b"], 6)
    assert tokens(complete(front, "alpha")[1]) == greedy(front.paths["a"], 6)
    assert states(front) == {"alpha": "loaded", "beta": "loaded", "gamma": "unloaded"}


def test_unknown_models_and_paths_are_refused_naming_the_served_ones(front):
    status, body = complete(front, "delta")
    assert status == 404 and body["error"]["message"] == \
        "model 'delta' is not served here; served: alpha, beta, gamma"
    status, body, _ = front.request("POST", "/models/load", {"model": front.paths["a"]})
    assert status == 404 and "never a path" in body["error"]["message"]


def test_a_killed_executor_of_one_model_leaves_the_others_answering(front):
    engines = {n: p for p in child_pids(front.proc.pid) for n in ("alpha", "beta")
               if alive(p) and f"{n}.json" in cmdline(p)}
    executor = next(p for p in child_pids(engines["beta"]) if "executor" in cmdline(p))
    os.kill(executor, signal.SIGKILL)
    assert complete(front, "alpha")[0] == 200
    wait_for(lambda: complete(front, "beta")[0] == 200)
    assert tokens(complete(front, "beta")[1]) == greedy(front.paths["b"], 6)


def test_the_budget_unloads_the_least_recently_used_and_an_idle_model_unloads(front):
    complete(front, "beta")
    status, body = complete(front, "gamma")             # 3 GiB past the 2.5 GiB budget
    assert status == 200 and tokens(body) == greedy(front.paths["c"], 6)
    _, listing, _ = front.request("GET", "/v1/models")
    beta = next(m for m in listing["data"] if m["id"] == "beta")
    assert beta["status"] == {"value": "unloaded", "reason":
                              "unloaded to make room for 'gamma' (least recently used)"}
    assert states(front) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
    wait_for(lambda: states(front)["gamma"] == "unloaded", timeout=15)   # idle for 2 s
    _, listing, _ = front.request("GET", "/v1/models")
    assert listing["data"][2]["status"] == {"value": "unloaded", "reason": "idle for 2s"}


def test_metrics_name_each_model(front):
    import urllib.request
    with urllib.request.urlopen(front.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'pagewire:model_state{model_name="alpha",state="loaded"} 1' in text
    assert 'pagewire:model_loads_total{model_name="beta"} 1' in text
    assert 'pagewire:model_state{model_name="gamma",state="unloaded"} 1' in text
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1


def test_unloading_a_model_lets_its_request_in_flight_finish(front):
    """Even a pinned model's (it loads again on its next request)."""
    streaming = threading.Event()

    def stream() -> list[str]:
        body = json.dumps({"model": "alpha", "prompt": PROMPT, "max_tokens": 200,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        request = urllib.request.Request(front.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            streaming.set()                  # its engine is answering it
            return [line for line in r.read().decode().splitlines() if line.startswith("data")]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        assert streaming.wait(30)
        status, body, _ = front.request("POST", "/models/unload", {"model": "alpha"})
        assert (status, body["state"]) == (200, "unloaded")
        events = running.result()
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 200
    status, body, _ = front.request("POST", "/models/unload", {"model": "alpha"})
    assert status == 400 and body["error"]["message"] == "model 'alpha' is not loaded"


def test_a_pinned_model_that_cannot_load_stops_the_server_saying_why(tmp_path):
    import subprocess
    import sys

    from pagewire.testing.server import free_port
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["Nope"]}')
    (tmp_path / "models.toml").write_text('[models.bad]\nmodel = "bad"\npinned = true\n')
    done = subprocess.run([sys.executable, "-m", "pagewire.cli", "serve", "--models-file",
                           str(tmp_path / "models.toml"), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "pinned model 'bad' failed to load: its engine exited with code 2: " \
        f"{tmp_path / 'bad'}: architecture Nope is not supported" in done.stderr
