"""`pagewire serve` options over real HTTP, through the official openai client: API keys (flag
and $PAGEWIRE_API_KEY), the waiting-queue limit (503), n / best_of / beam search, cache_salt."""
from __future__ import annotations

import concurrent.futures
import os

import openai
import pytest

from pagewire.testing.server import Server, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "64MiB"]
PROMPT = "The capital of France is"


def start(args: list[str], env: dict[str, str] | None = None):
    """Yield a running server, always stopping it (a generator for module fixtures). API keys
    come only from `args` and `env`, never from this process's environment."""
    with running_server(SMALL + args, {"PAGEWIRE_API_KEY": None, "VLLM_API_KEY": None,
                                       **(env or {})}) as srv:
        yield srv


def client_for(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed_server():
    """Keys k1, k2 from the flag and k3, k4 from the environment."""
    yield from start(["--api-key", "k1", "--api-key", "k2"], {"PAGEWIRE_API_KEY": "k3,k4"})


@pytest.fixture(scope="module")
def client(keyed_server):
    return client_for(keyed_server, "k1")


@pytest.fixture(scope="module")
def queue_server():
    yield from start(["--max-num-seqs", "1", "--max-num-queued-reqs", "1"])


def assert_error(reply: dict, code: int, error_type: str, param: str | None = None) -> None:
    err = reply["error"]
    assert set(reply) == {"error"}
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["type"] == error_type and err["param"] == param
    assert isinstance(err["message"], str) and err["message"]


# -- API keys ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["k1", "k2", "k3", "k4"])
def test_every_configured_key_is_accepted(keyed_server, key):
    r = client_for(keyed_server, key).completions.create(model=MODEL, prompt=PROMPT,
                                                         max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2 and len(r.choices) == 1
    (model,) = client_for(keyed_server, key).models.list().data
    assert model.id == MODEL


@pytest.mark.parametrize("headers", [
    {},                                           # missing
    {"Authorization": "Bearer wrong"},
    {"Authorization": "Bearer k1x"},              # a longer key that starts with a good one
    {"Authorization": "Bearer k"},                # a prefix of a good key
    {"Authorization": "Bearer "},                 # empty
    {"Authorization": "Bearer k3,k4"},            # the env value as a whole is not a key
    {"Authorization": "k1"},                      # no scheme
    {"Authorization": "Basic k1"},                # another scheme
])
def test_missing_or_wrong_key_gets_401_error_json(keyed_server, headers):
    for method, path, body in [("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                               ("POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hi"}]}),
                               ("GET", "/v1/models", None)]:
        code, reply, _ = keyed_server.request(method, path, body, headers=headers)
        assert code == 401, (method, path)
        assert_error(reply, 401, "AuthenticationError")


def test_raw_requests_with_a_key_succeed_and_the_scheme_is_case_insensitive(keyed_server):
    for auth in ["Bearer k2", "bearer k4", "BEARER k1", "Bearer  k3 "]:
        code, reply, _ = keyed_server.request("POST", "/v1/completions",
                                              {"prompt": "Hi", "max_tokens": 1},
                                              headers={"Authorization": auth})
        assert code == 200, auth
        assert reply["usage"]["completion_tokens"] == 1


def test_wrong_key_through_the_client_is_an_authentication_error(keyed_server):
    with pytest.raises(openai.AuthenticationError) as info:
        client_for(keyed_server, "nope").completions.create(model=MODEL, prompt="Hi",
                                                            max_tokens=1)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "AuthenticationError" and info.value.body["code"] == 401


def test_health_needs_no_key(keyed_server):
    code, reply, _ = keyed_server.request("GET", "/health")
    assert code == 200 and reply == {"status": "ok"}
    code, _, _ = keyed_server.request("GET", "/health", headers={"Authorization": "Bearer bad"})
    assert code == 200


def test_trace_switch_needs_a_server_started_with_trace(keyed_server):
    assert keyed_server.request("POST", "/admin/trace", {"enabled": True})[0] == 401
    code, reply, _ = keyed_server.request("POST", "/admin/trace", {"enabled": True},
                                          {"Authorization": "Bearer k1"})
    assert_error(reply, 409, "ConflictError")
    assert "--trace" in reply["error"]["message"]


# -- the waiting-queue limit -------------------------------------------------------------------

def test_a_full_queue_refuses_with_503_and_the_server_keeps_serving(queue_server):
    """One sequence runs (--max-num-seqs 1) and one may wait (--max-num-queued-reqs 1): with a
    long request running, of three more arriving together exactly one waits and two are
    refused."""
    client = client_for(queue_server)
    blocker = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    chunks = iter(blocker)
    first = next(chunks)                          # it is running now, not waiting
    assert first.choices[0].index == 0

    def follow(_):
        try:
            return client.completions.create(model=MODEL, prompt="Once upon a time",
                                             max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(follow, i) for i in range(3)]
        done = concurrent.futures.as_completed(futures, timeout=60)
        refused = [next(done).result(), next(done).result()]   # the two refusals come first
        for e in refused:
            assert isinstance(e, openai.APIStatusError), e
            assert e.status_code == 503
            assert e.body == {"message": "the queue is full (1 requests waiting)",
                              "type": "ServiceUnavailableError", "param": None, "code": 503}
        assert sum(f.done() for f in futures) == 2   # the third still waits behind the blocker
        blocker.close()                           # the client goes: the blocker is aborted
        waited = next(done).result()
    assert isinstance(waited, openai.types.Completion), waited
    assert waited.usage.completion_tokens == 8 and waited.choices[0].finish_reason == "length"

    after = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert after.usage.completion_tokens == 4
    assert queue_server.request("GET", "/health")[:2] == (200, {"status": "ok"})


def test_a_refusal_is_openai_error_json(queue_server):
    """The raw 503 body, with the queue full again: of two raw requests arriving while a long
    one runs, one waits and the other is refused."""
    client = client_for(queue_server)
    blocker = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(blocker))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(queue_server.request, "POST", "/v1/completions",
                               {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
                   for _ in range(2)]
        done = concurrent.futures.as_completed(futures, timeout=60)
        code, reply, _ = next(done).result()
        assert code == 503
        assert_error(reply, 503, "ServiceUnavailableError")
        assert reply["error"]["message"] == "the queue is full (1 requests waiting)"
        blocker.close()
        code, reply, _ = next(done).result()
    assert code == 200 and reply["usage"]["completion_tokens"] == 2


# -- n, best_of, beam search -------------------------------------------------------------------

def completions(client, **kw):
    kw.setdefault("max_tokens", 12)
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **kw)


def test_n_3_seeded_gives_3_distinct_choices_and_repeats_exactly(client):
    r = completions(client, n=3, temperature=0.8, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage.completion_tokens == 36
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3                   # the n samples are not copies of one another
    again = completions(client, n=3, temperature=0.8, seed=7)
    assert [c.text for c in again.choices] == texts


def test_best_of_3_with_n_1_returns_one_choice(client):
    r = completions(client, n=1, best_of=3, temperature=0.8, seed=3)
    assert len(r.choices) == 1
    assert r.choices[0].index == 0 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 36        # all best_of sequences were generated
    again = completions(client, n=1, best_of=3, temperature=0.8, seed=3)
    assert again.choices[0].text == r.choices[0].text


def test_best_of_3_with_n_2_returns_two_choices(client):
    r = completions(client, n=2, best_of=3, temperature=0.8, seed=5)
    assert [c.index for c in r.choices] == [0, 1]


def test_best_of_above_n_cannot_stream(keyed_server, client):
    with pytest.raises(openai.BadRequestError) as info:
        list(completions(client, n=1, best_of=3, stream=True))
    assert info.value.status_code == 400 and info.value.body["param"] == "best_of"
    assert "best_of" in info.value.body["message"]
    code, reply, _ = keyed_server.request(
        "POST", "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "best_of": 4, "stream": True},
        headers={"Authorization": "Bearer k1"})
    assert code == 400
    assert_error(reply, 400, "BadRequestError", "best_of")


def test_best_of_equal_to_n_streams(client):
    chunks = list(completions(client, n=2, best_of=2, temperature=0.8, seed=1, max_tokens=4,
                              stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert sorted(c.choices[0].finish_reason for c in chunks
                  if c.choices[0].finish_reason) == ["length", "length"]


@pytest.mark.parametrize("n, best_of", [(1, 0), (2, 1), (1, 17)])
def test_bad_best_of_is_refused(keyed_server, n, best_of):
    code, reply, _ = keyed_server.request(
        "POST", "/v1/completions", {"prompt": "Hi", "n": n, "best_of": best_of},
        headers={"Authorization": "Bearer k1"})
    assert code == 400
    assert_error(reply, 400, "BadRequestError", "best_of")


def test_beam_search_n_2_returns_two_beams_and_repeats_exactly(client):
    r = completions(client, n=2, seed=7, extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    texts = [c.text for c in r.choices]
    assert texts[0] != texts[1]                   # two different beams
    again = completions(client, n=2, seed=7, extra_body={"use_beam_search": True})
    assert [c.text for c in again.choices] == texts


# -- cache_salt --------------------------------------------------------------------------------

def test_cache_salt_is_accepted_and_does_not_change_the_output(keyed_server, client):
    plain = completions(client, temperature=0)
    salted = completions(client, temperature=0, extra_body={"cache_salt": "tenant-a"})
    assert salted.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"cache_salt": "tenant-b"})
    assert chat.choices[0].finish_reason in ("stop", "length")
    code, reply, _ = keyed_server.request(
        "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "cache_salt": "s"},
        headers={"Authorization": "Bearer k2"})
    assert code == 200 and reply["usage"]["completion_tokens"] == 2


def test_tokenizer_endpoints_need_the_key(keyed_server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        code, reply, _ = keyed_server.request("POST", path, body)
        assert code == 401 and reply["error"]["code"] == 401
        code, _, _ = keyed_server.request("POST", path, body, headers={"Authorization": "Bearer k2"})
        assert code == 200


# -- KV-Compress -------------------------------------------------------------------------------

def test_kv_compress_serves_its_requests_and_refuses_what_it_cannot_compress():
    """A 300-token prompt compressed after its prefill (rate 0.5, window 16) and at a request's
    own rate; n = 2 and a rate out of range are 400s naming their field."""
    prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
    for srv in start(["--no-enable-prefix-caching", "--kv-compress-rate", "0.5",
                      "--kv-compress-window", "16"]):
        for extra in ({}, {"kv_compress_rate": 0.25}):
            code, reply, _ = srv.request("POST", "/v1/completions", {
                "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                **extra})
            assert code == 200 and reply["usage"]["completion_tokens"] == 24
            assert reply["usage"]["prompt_tokens"] > 250
        for body, param in (({"n": 2}, "n"), ({"kv_compress_rate": 1.5}, "kv_compress_rate")):
            code, reply, _ = srv.request("POST", "/v1/completions",
                                         {"prompt": prompt, "max_tokens": 2, **body})
            assert_error(reply, 400, "BadRequestError", param)
