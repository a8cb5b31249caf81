"""`pagewire serve` as a real process with the default model, through the official openai
client: chat and completions, streaming and not, concurrent requests, bad input, shutdown."""
from __future__ import annotations

import concurrent.futures
import json
import os
import tempfile

import pytest

from pagewire.testing.server import (Server, alive, child_pids, cmdline, openai_client,
                                     running_server)

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def kv_events_dir():
    with tempfile.TemporaryDirectory(dir="/tmp") as path:
        yield path


@pytest.fixture(scope="module")
def server(kv_events_dir):
    events = {"enable_kv_cache_events": True, "topic": "kv",
              "endpoint": f"ipc://{kv_events_dir}/kv", "replay_endpoint": f"ipc://{kv_events_dir}/r"}
    with running_server(["--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                         "--kv-events-config", json.dumps(events)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_processes_name_themselves(server):
    names = sorted(cmdline(pid) for pid in child_pids(server.proc.pid))
    assert names == ["pagewire: detokenizer", "pagewire: executor 0", "pagewire: gateway",
                     "pagewire: scheduler", "pagewire: tokenizer 0"]


def test_models(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "pagewire"
    assert model.model_extra["max_model_len"] == 1024


def test_chat_names_paris(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10


def test_chat_streams_token_by_token(client):
    stream = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                            max_tokens=30, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3 and "Paris" in "".join(pieces)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= len(pieces)


def test_stream_and_non_stream_agree(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     temperature=0, max_tokens=12)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12, stream=True))
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "length"


def test_completions_with_prompt_list_n_and_stop(client):
    r = client.completions.create(model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], n=2,
                                  temperature=0, max_tokens=20, stop=[" 6"])
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == " 4, 5," and r.choices[0].finish_reason == "stop"
    assert r.choices[1].text == r.choices[0].text
    assert r.choices[2].text.startswith(" d, e")


def test_token_id_prompts(client):
    r = client.completions.create(model=MODEL, prompt=[[504, 3575, 282, 4649, 314]],
                                  temperature=0, max_tokens=3)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 3


# nats: bfloat16 sums in another batch shape move logprobs by far less than this, so two
# greedy runs of one prompt may part only where their two best tokens were about this close.
NEAR_TIE = 0.5


def assert_same_greedy_answer(first, again) -> None:
    """Two greedy chat answers to one prompt, run in other batches: the same tokens, or the
    same up to a position where each run's own pick and the other's were within NEAR_TIE (in
    bfloat16 a near-tie may flip). An answer made of another request's tokens, or decoded
    over wrong K/V, parts from the first position where it differs with a clear margin."""
    a, b = first.choices[0].logprobs.content, again.choices[0].logprobs.content
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x.token != y.token), min(len(a), len(b)))
    if k == len(a) == len(b):
        assert first.choices[0].message.content == again.choices[0].message.content
        return
    for mine, theirs in ((a, b), (b, a)):
        if k == len(mine):              # this run ended here (its stop token is not listed)
            continue
        picks = {t.token: t.logprob for t in mine[k].top_logprobs}
        runner_up = sorted(picks.values())[-2]
        other = theirs[k].token if k < len(theirs) else None
        margin = mine[k].logprob - (picks[other] if other in picks else runner_up)
        said = "".join(t.token for t in mine[:k])
        assert (other is None or other in picks) and margin < NEAR_TIE, \
            f"after {said!r} one run picked {mine[k].token!r}, the other {other!r}: {picks}"


def test_concurrent_requests_answer_each_question_as_its_repeat_does(client):
    questions = ["What is the capital of France?", "Name a primary color.",
                 "What is 2 + 2?", "Say hello."] * 2

    def ask(q):
        return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24,
                                              logprobs=True, top_logprobs=2,
                                              messages=[{"role": "user", "content": q}])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, questions))
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert "Paris" in answers[0].choices[0].message.content
    assert "4" in answers[2].choices[0].message.content
    for first, again in zip(answers[:4], answers[4:]):
        assert_same_greedy_answer(first, again)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi " * 1100}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 1024}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [[1, 2], [99999999]]}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL}, 400, None),
    # hostile: bytes that are not UTF-8, wrong types deep down, lists past the caps
    (b'{"prompt": "caf\xe9"}', 400, None),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, 400, None),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(5000)]}, 400, "stop"),
    ({"prompt": "hi", "stop": "x" * 2000}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": list(range(5000))}, 400, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(5000)}}, 400, "logit_bias"),
    ({"prompt": "hi", "bad_words": ["w"] * 300}, 400, "bad_words"),
    ({"prompt": ["hi"] * 1100, "max_tokens": 1}, 400, "prompt"),
])
def test_bad_input_gets_an_error_and_the_server_keeps_serving(server, client, body, status, param):
    code, reply, _ = server.request("POST", "/v1/completions", body)
    assert code == status
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param and err["message"]
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("body, param", [
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, None),
    ({"messages": [{"role": "user", "content": "hi"}] * 5000}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 300}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
])
def test_hostile_chat_bodies_get_400_and_the_server_keeps_serving(server, client, body, param):
    code, reply, _ = server.request("POST", "/v1/chat/completions", body)
    assert code == 400 and reply["error"]["param"] == param and reply["error"]["message"]
    ok = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_request_id_is_echoed(server):
    code, _, headers = server.request("POST", "/v1/completions",
                                      {"prompt": "Hi", "max_tokens": 1},
                                      headers={"X-Request-Id": "abc-123"})
    assert code == 200 and headers["X-Request-Id"] == "abc-123"


def test_sigterm_stops_everything_and_cleans_up():
    with tempfile.TemporaryDirectory(dir="/tmp") as run_parent:   # short: ipc paths are capped
        srv = Server(["--max-model-len", "256", "--kv-cache-memory", "64MiB"], run_parent)
        children = child_pids(srv.proc.pid)
        assert len(children) == 5 and os.listdir(run_parent)
        assert srv.stop() == 0
        assert not [pid for pid in children if alive(pid)]
        assert os.listdir(run_parent) == []


def _stream_session(server, session: str, first: list[int], out: list):
    """The session's first request (streamed SSE); its token ids appended to `out`."""
    import json
    import urllib.request
    body = json.dumps({"model": MODEL, "prompt": first, "request_id": session,
                       "stream_input": True, "stream": True, "max_tokens": 12,
                       "temperature": 0, "ignore_eos": True, "logprobs": 0,
                       "return_tokens_as_token_ids": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    out.append(event["usage"])
                for choice in event["choices"]:
                    out += [int(t.removeprefix("token_id:"))
                            for t in (choice.get("logprobs") or {}).get("tokens", [])]


def _wait_open(server, session: str) -> None:
    """Until the gateway knows the session (its first request reached it)."""
    import time
    for _ in range(200):
        code, _, _ = server.request("POST", f"/v1/completions/{session}/input",
                                    {"prompt": []})
        if code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the session never opened")


def test_a_prompt_streamed_in_pieces_answers_as_the_whole_prompt(server):
    """POST /v1/completions with stream_input opens a session; pieces go to
    /v1/completions/{request_id}/input; the last one starts generation. Same greedy tokens
    as the whole prompt sent at once; the session is gone after."""
    import random
    rng = random.Random(21)
    prompt = [rng.randrange(1000, 40000) for _ in range(70)]
    tokens: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(_stream_session, server, "piecewise", prompt[:30], tokens)
        _wait_open(server, "piecewise")
        code, reply, _ = server.request("POST", "/v1/completions/piecewise/input",
                                        {"prompt": prompt[30:50]})
        assert (code, reply) == (200, {"request_id": "piecewise", "object": "prompt.piece",
                                       "last": False})
        code, _, _ = server.request("POST", "/v1/completions/piecewise/input",
                                    {"prompt": prompt[50:], "last": True})
        assert code == 200
        done.result(timeout=120)
    code, whole, _ = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert code == 200
    assert tokens[:-1] == [int(t.removeprefix("token_id:"))
                           for t in whole["choices"][0]["logprobs"]["tokens"]]
    assert tokens[-1]["prompt_tokens"] == 70 == whole["usage"]["prompt_tokens"]
    code, reply, _ = server.request("POST", "/v1/completions/piecewise/input", {"prompt": "x"})
    assert code == 404 and reply["error"]["param"] == "request_id"


def test_streamed_prompt_errors(server):
    code, reply, _ = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "hi", "stream_input": True})
    assert code == 400 and "request_id" in reply["error"]["message"]
    code, reply, _ = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "hi", "stream_input": True, "request_id": "s", "n": 2})
    assert code == 400 and "n = 1" in reply["error"]["message"]


def test_the_scheduler_publishes_the_blocks_a_prompt_stored(server, kv_events_dir):
    """--kv-events-config: a replay from 0 (vLLM's replay protocol, its event schema as
    tests/actors/test_kv_events.py writes it) holds, from the first batch's AllBlocksCleared
    on, the BlockStored events of a token-id prompt's full blocks: pagewire's hash chain."""
    import zmq

    from pagewire.scheduler.kv_manager import block_hashes
    from tests.actors.test_kv_events import DECODER, AllBlocksCleared, BlockStored, apply, ext
    prompt = list(range(1000, 1100))                    # 6 full blocks of 16
    server.request("POST", "/v1/completions", {"model": MODEL, "prompt": prompt,
                                               "max_tokens": 1})
    want = [ext(h) for h in block_hashes(prompt, 16, "kv=auto\x00", [])]
    ctx = zmq.Context()
    replay = ctx.socket(zmq.DEALER)
    replay.connect(f"ipc://{kv_events_dir}/r")
    try:
        for _ in range(50):                  # the last step's batch may still be on its way
            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = []
            while True:
                assert replay.poll(10_000)
                _, seq, payload = replay.recv_multipart()
                if payload == b"":
                    break
                batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
            held: set[int] = set()
            for _, batch in batches:
                apply(held, batch)
            if held >= set(want):
                break
        assert [s for s, _ in batches] == list(range(len(batches)))
        assert isinstance(batches[0][1].events[0], AllBlocksCleared)
        mine = [e for _, b in batches for e in b.events
                if isinstance(e, BlockStored) and set(e.block_hashes) & set(want)]
        assert [h for e in mine for h in e.block_hashes] == want
        assert [t for e in mine for t in e.token_ids] == prompt[:96]
        assert mine[0].parent_block_hash is None and mine[0].medium == "GPU"
    finally:
        replay.close(0)
        ctx.term()
