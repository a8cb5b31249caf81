"""RequestTokenizer: encoding (text, ids, chat template), length checks, and the messages it
produces for the detokenizer and the scheduler."""
from __future__ import annotations

import jinja2
import pytest

from pagewire.config import EngineConfig
from pagewire.tokenizer import RequestTokenizer
from pagewire.wire import SamplingParams
from pagewire.wire.to_detokenizer import PROMPT_TAIL, DetokStart
from pagewire.wire.to_gateway import RequestFailed
from pagewire.wire.to_scheduler import NewRequest
from pagewire.wire.to_tokenizer import ChatMessage, TokenizeRequest

MAX_LEN = 64


@pytest.fixture(scope="module")
def config():
    return EngineConfig.from_options(max_model_len=MAX_LEN).resolve()


@pytest.fixture(scope="module")
def tokenizer(config):
    from pagewire.hf_tokenizer import load_tokenizer
    return load_tokenizer(config.model.model_info)


@pytest.fixture(scope="module")
def rt(config, tokenizer):
    return RequestTokenizer(config, tokenizer)


def _req(sampling=None, **kw) -> TokenizeRequest:
    return TokenizeRequest(req_id="r1", arrival_time=123.5,
                           sampling=sampling or SamplingParams(max_tokens=8), **kw)


def _ok(result):
    assert not isinstance(result, RequestFailed), result
    start, new = result
    assert type(start) is DetokStart and type(new) is NewRequest
    return start, new


def _failed(result, param) -> RequestFailed:
    assert isinstance(result, RequestFailed), result
    assert (result.req_id, result.status, result.param) == ("r1", 400, param)
    assert result.error_type == "BadRequestError"
    return result


def test_good_text_request_gives_detok_start_then_new_request(rt, tokenizer):
    sampling = SamplingParams(max_tokens=10, stop=["\n"], include_stop_str_in_output=True,
                              skip_special_tokens=False, min_tokens=3, seed=5)
    prompt = "The quick brown fox jumps over the lazy dog, said Héloïse."
    start, new = _ok(rt.process(_req(sampling, prompt=prompt)))
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    assert len(ids) > PROMPT_TAIL == 6
    assert new == NewRequest(req_id="r1", prompt_token_ids=ids, sampling=sampling,
                             arrival_time=123.5)
    assert start == DetokStart(req_id="r1", prompt_tail=ids[-6:], num_prompt_tokens=len(ids),
                               stop=["\n"], include_stop_str_in_output=True,
                               skip_special_tokens=False, min_tokens=3)


def test_prompt_token_ids_pass_through_unchanged(rt, config):
    ids = [0, 17, 5, 9, 33, 2, 1, config.model.model_info.vocab_size - 1]
    start, new = _ok(rt.process(_req(prompt_token_ids=ids)))
    assert new.prompt_token_ids == ids and start.prompt_tail == ids[-6:]
    assert start.num_prompt_tokens == len(ids)


def test_short_prompt_tail_is_the_whole_prompt(rt):
    start, _ = _ok(rt.process(_req(prompt_token_ids=[7, 8, 9])))
    assert start.prompt_tail == [7, 8, 9] and start.num_prompt_tokens == 3


def test_chat_request_renders_the_chat_template(rt, tokenizer):
    messages = [ChatMessage(role="system", content="You answer in one word."),
                ChatMessage(role="user", content="Capital of France?")]
    start, new = _ok(rt.process(_req(messages=messages)))
    expected = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], tokenize=True,
        add_generation_prompt=True, return_dict=False)
    assert new.prompt_token_ids == list(expected)
    assert tokenizer.decode(new.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert start.prompt_tail == list(expected)[-6:]


def test_chat_request_without_generation_prompt(rt, tokenizer):
    messages = [ChatMessage(role="user", content="hi")]
    _, new = _ok(rt.process(_req(messages=messages, add_generation_prompt=False)))
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                             add_generation_prompt=False, return_dict=False)
    assert new.prompt_token_ids == list(expected)
    assert not tokenizer.decode(new.prompt_token_ids).endswith("assistant\n")


def test_chat_message_without_content_counts_as_empty(rt, tokenizer):
    _, new = _ok(rt.process(_req(messages=[ChatMessage(role="user")])))
    expected = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    assert new.prompt_token_ids == list(expected)


def test_prompt_over_max_model_len_is_refused(rt):
    failed = _failed(rt.process(_req(prompt_token_ids=[5] * 100)), "prompt")
    assert "64" in failed.message and "100" in failed.message


def test_prompt_exactly_max_model_len_leaves_no_room(rt):
    _failed(rt.process(_req(SamplingParams(max_tokens=None), prompt_token_ids=[5] * MAX_LEN)),
            "prompt")
    _ok(rt.process(_req(SamplingParams(max_tokens=None), prompt_token_ids=[5] * (MAX_LEN - 1))))


def test_long_text_prompt_is_refused(rt):
    _failed(rt.process(_req(prompt="word " * 200)), "prompt")


def test_prompt_plus_max_tokens_over_max_model_len_is_refused(rt):
    failed = _failed(rt.process(_req(SamplingParams(max_tokens=25), prompt_token_ids=[5] * 40)),
                     "max_tokens")
    assert "65" in failed.message
    _ok(rt.process(_req(SamplingParams(max_tokens=24), prompt_token_ids=[5] * 40)))


def test_chat_prompt_plus_max_tokens_is_checked_after_templating(rt, tokenizer):
    messages = [ChatMessage(role="user", content="hi")]
    n = len(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False))
    _ok(rt.process(_req(SamplingParams(max_tokens=MAX_LEN - n), messages=messages)))
    _failed(rt.process(_req(SamplingParams(max_tokens=MAX_LEN - n + 1), messages=messages)),
            "max_tokens")


@pytest.mark.parametrize("bad", [-1, 49152, 10**9])
def test_out_of_range_token_ids_are_refused(rt, config, bad):
    assert config.model.model_info.vocab_size == 49152
    failed = _failed(rt.process(_req(prompt_token_ids=[1, 2, bad, 3])), "prompt")
    assert str(bad) in failed.message


@pytest.mark.parametrize("kw", [{"prompt": ""}, {"prompt_token_ids": []}])
def test_empty_prompt_is_refused(rt, kw):
    failed = _failed(rt.process(_req(**kw)), "prompt")
    assert "empty" in failed.message


def test_model_without_chat_template_refuses_messages(rt, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    _failed(rt.process(_req(messages=[ChatMessage(role="user", content="hi")])), "messages")


def test_template_error_is_a_400_without_param(rt, tokenizer, monkeypatch):
    def broken(*a, **kw):
        raise jinja2.TemplateError("Conversation roles must alternate")
    monkeypatch.setattr(tokenizer, "apply_chat_template", broken)
    failed = rt.process(_req(messages=[ChatMessage(role="user", content="hi")]))
    assert isinstance(failed, RequestFailed)
    assert (failed.status, failed.param) == (400, None)
    assert failed.message == "TemplateError: Conversation roles must alternate"
