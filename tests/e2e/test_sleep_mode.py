"""Sleep mode served (--enable-sleep-mode): the controls cross gateway -> scheduler -> executor
as real processes. /sleep, /is_sleeping, /wake_up in vLLM's shapes; a completion while asleep
is a 503 and one in flight when sleep comes ends ("abort"), never hangs; the same greedy tokens
after waking; /update_weights (SGLang's body) serves the new checkpoint's transformers tokens,
and refuses a missing path or other shapes with a 400 while the old weights serve on; every
KV block is back after each."""
from __future__ import annotations

import pytest

from pagewire.testing.server import openai_client, running_server
from tests.helpers import HFOracle, assert_greedy_equal, make_tiny_llama

pytestmark = pytest.mark.slow
PROMPT = list(range(20, 36))


@pytest.fixture(scope="module")
def served(tmp_path_factory, smol_tokenizer_dir):
    root = tmp_path_factory.mktemp("sleep-e2e")
    paths = {"a": make_tiny_llama(str(root / "a"), smol_tokenizer_dir, seed=5),
             "b": make_tiny_llama(str(root / "b"), smol_tokenizer_dir, seed=6),
             "wide": make_tiny_llama(str(root / "wide"), smol_tokenizer_dir, seed=7,
                                     shape="gqa2-d128")}
    args = [paths["a"], "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory",
            "16MiB", "--served-model-name", "tiny", "--enable-sleep-mode"]
    with running_server(args) as srv:
        yield srv, paths


def greedy(srv, n: int = 10) -> tuple[int, list[int] | dict]:
    code, reply, _ = srv.request("POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    if code != 200:
        return code, reply
    return code, [int(t.removeprefix("token_id:"))
                  for t in reply["choices"][0]["logprobs"]["tokens"]]


def test_sleep_wake_and_new_weights_over_the_wire(served):
    srv, paths = served
    code, tokens = greedy(srv)
    assert code == 200
    assert srv.request("GET", "/is_sleeping")[:2] == (200, {"is_sleeping": False})
    stream = iter(openai_client(srv).completions.create(       # in flight as sleep comes
        model="tiny", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert next(stream).choices[0].text is not None
    code, reply, _ = srv.request("POST", "/sleep?level=1")
    assert code == 200 and reply["asleep"] == ["weights", "kv_cache"], reply
    assert reply["aborted_requests"] == 1
    rest = list(stream)                                   # ends ("abort"), never hangs
    assert len(rest) < 200 and rest[-1].choices[0].finish_reason == "abort"
    assert srv.request("GET", "/is_sleeping")[:2] == (200, {"is_sleeping": True})
    code, reply = greedy(srv)
    assert code == 503 and "sleeping" in reply["error"]["message"]
    assert srv.request("POST", "/sleep?level=2")[0] == 200          # twice: a no-op
    assert srv.request("POST", "/wake_up?tags=weights")[1] == \
        {"is_sleeping": True, "asleep": ["kv_cache"]}
    assert srv.request("POST", "/wake_up?tags=kv_cache")[1] == \
        {"is_sleeping": False, "asleep": []}
    assert srv.request("POST", "/wake_up")[0] == 200                # awake: a no-op
    assert greedy(srv) == (200, tokens)
    assert srv.kv_blocks_freed()

    for body, expect in (({"model_path": "/nowhere"}, "cannot read weights"),
                         ({"model_path": paths["wide"]}, "hidden_size 256 (served: 128)"),
                         ({}, "give the new weights' path")):
        code, reply, _ = srv.request("POST", "/update_weights", body)
        assert code == 400 and expect in reply["error"]["message"], reply
    assert srv.request("POST", "/sleep?level=3")[0] == 400
    assert greedy(srv) == (200, tokens)                             # the old weights serve on
    code, reply, _ = srv.request("POST", "/update_weights_from_disk",
                                 {"model_path": paths["b"]})
    assert code == 200 and reply["success"], reply
    code, ours = greedy(srv)
    theirs, logits = HFOracle.from_dir(paths["b"]).greedy(PROMPT, 10)
    assert_greedy_equal(ours, theirs, logits, "served after /update_weights")
    assert srv.kv_blocks_freed()
