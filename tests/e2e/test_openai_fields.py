"""The OpenAI request fields and vLLM's extensions over HTTP, with the official client:
logprobs in both endpoints (streamed and not), echo, prompt_logprobs, penalties, logit_bias,
allowed_token_ids, bad_words, truncate_prompt_tokens, response_format, chat_template_kwargs,
and the 400s for what is out of range."""
from __future__ import annotations

import pytest

from pagewire.testing.server import openai_client, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server():
    with running_server(["--max-model-len", "512", "--kv-cache-memory", "64MiB"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_completion_logprobs_line_up_with_the_text(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) >= 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i])
               for i, top in enumerate(lp.top_logprobs))          # greedy: the sampled is the top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_chat_logprobs_streamed_and_not_agree(client):
    # Warm the prefix cache first, so both compared requests recompute the same uncached tail
    # (a first request prefills the whole prompt with the dequantized weights, a cached one
    # its short tail with the GGUF's blocks, which in bfloat16 differ by the weights' rounding).
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0)
    full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert "".join(c.token for c in content) == full.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                                temperature=0, logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == \
        [(c.token, round(c.logprob, 4)) for c in content]


def test_echo_with_logprobs_reports_the_prompt_too(client):
    prompt = "One, two, three,"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert r.usage.completion_tokens == 3


def test_prompt_logprobs_extension(client):
    r = client.completions.create(model=MODEL, prompt="Hello there friend", max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.usage.prompt_tokens
    assert all(all(v["logprob"] <= 0 for v in entry.values()) for entry in plp[1:])


def test_logit_bias_and_allowed_tokens(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                  logit_bias={"42": 100})
    assert r.choices[0].text == client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
        extra_body={"allowed_token_ids": [42]}).choices[0].text


def test_penalties_change_a_repetitive_greedy_answer(client):
    prompt = "1, 1, 1, 1, 1, 1, 1, 1,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    penalised = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5})
    assert plain.choices[0].text.count("1") > penalised.choices[0].text.count("1")


def test_bad_words_and_truncation(client):
    plain = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0)
    assert "Paris" in plain.choices[0].message.content
    banned = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
        temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10


def test_response_format_and_template_kwargs(client, server):
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                        response_format={"type": "text"},
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert ok.choices[0].finish_reason in ("stop", "length")
    for body, param in (
            ({"messages": ASK, "response_format": {"type": "xml"}}, "response_format"),
            ({"messages": ASK, "chat_template_kwargs": {"tools": "x"}}, "chat_template_kwargs"),
            ({"messages": ASK, "logprobs": True, "top_logprobs": 21}, "logprobs"),
            ({"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
            ({"messages": ASK, "presence_penalty": 3}, "presence_penalty"),
            ({"messages": ASK, "logit_bias": {"999999": 1}}, "logit_bias"),
            ({"messages": ASK, "repetition_penalty": 0}, "repetition_penalty")):
        code, reply, _ = server.request("POST", "/v1/chat/completions", body)
        assert (code, reply["error"]["param"]) == (400, param), body


def test_tokenize_detokenize_and_version(server):
    code, tok, _ = server.request("POST", "/tokenize", {"prompt": "Hello world",
                                                         "return_token_strs": True})
    assert code == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == 512
    code, detok, _ = server.request("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert (code, detok["prompt"]) == (200, "Hello world")
    code, chat, _ = server.request("POST", "/tokenize", {"messages": ASK})
    assert code == 200 and chat["count"] > tok["count"]
    code, bad, _ = server.request("POST", "/detokenize", {"tokens": [10**9]})
    assert code == 400 and bad["error"]["param"] == "tokens"
    code, version, _ = server.request("GET", "/version")
    assert code == 200 and version["version"]


def test_remaining_sampling_and_template_fields(client, server):
    base = dict(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=12)
    plain = client.completions.create(**base).choices[0].text
    # top_k=1 / min_p=1 at any temperature are greedy
    assert client.completions.create(**{**base, "temperature": 1.5},
                                     extra_body={"top_k": 1}).choices[0].text == plain
    assert client.completions.create(**{**base, "temperature": 1.5},
                                     extra_body={"min_p": 1.0}).choices[0].text == plain
    tok = server.request("POST", "/tokenize", {"prompt": plain})[1]["tokens"]
    stopped = client.completions.create(**base, extra_body={"stop_token_ids": [tok[1]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 2
    kept = client.completions.create(**base, stop=[" 5"],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(" 5")
    forced = client.completions.create(**{**base, "max_tokens": 4},
                                       extra_body={"min_tokens": 4, "stop_token_ids": [tok[0]],
                                                   "priority": 3})
    assert forced.usage.completion_tokens == 4
    chat = dict(model=MODEL, temperature=0, user="u-1")
    r = client.chat.completions.create(**chat, messages=ASK, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    special = client.chat.completions.create(**chat, messages=ASK, max_tokens=40,
                                             extra_body={"skip_special_tokens": False})
    assert special.choices[0].finish_reason == "stop"
    assert special.choices[0].message.content.endswith("<|im_end|>")
    cont = client.chat.completions.create(**chat, max_tokens=5, messages=ASK + [
        {"role": "assistant", "content": "Red, green"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert cont.choices[0].message.content.startswith(",") or \
        cont.choices[0].message.content.startswith(" and")
