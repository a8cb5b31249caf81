"""Logprobs, prompt logprobs, penalties, logit bias, allowed tokens and bad words in the
offline engine, checked against transformers' own log-probabilities on tiny random models."""
from __future__ import annotations

import random

import pytest
import torch

from pagewire import LLM, SamplingParams
from tests.helpers import make_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory, smol_tokenizer_dir):
    return make_tiny_llama(str(tmp_path_factory.mktemp("m")), smol_tokenizer_dir, "gqa2-d64")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, dtype="float32", block_size=8, num_kv_blocks=256, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def hf(model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is the distribution over token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)


def test_sampled_and_top_logprobs_are_the_models(llm, hf):
    p = prompt(1, 20)
    (out,) = llm.generate([p], SamplingParams(temperature=0.9, seed=3, max_tokens=6, logprobs=3,
                                              ignore_eos=True))
    c = out.outputs[0]
    ref = hf_logprobs(hf, p + c.token_ids)[len(p) - 1:-1]           # [6, V]
    assert [e.token_id for e in c.logprobs] == c.token_ids
    for i, e in enumerate(c.logprobs):
        assert e.logprob == pytest.approx(float(ref[i, e.token_id]), abs=1e-4)
        values, ids = ref[i].topk(3)
        assert [t for t, _, _ in e.top] == ids.tolist()
        assert [lp for _, _, lp in e.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_cover_every_prompt_token_across_chunks(llm, hf):
    p = prompt(2, 37)                      # 3 chunks at a 16-token budget
    (out,) = llm.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=2))
    entries = out.prompt_logprobs
    assert [e.token_id for e in entries] == p and entries[0].logprob is None
    ref = hf_logprobs(hf, p)
    for i, e in enumerate(entries[1:], start=1):
        assert e.logprob == pytest.approx(float(ref[i - 1, p[i]]), abs=1e-4)
        assert [t for t, _, _ in e.top] == ref[i - 1].topk(2).indices.tolist()


def test_logit_bias_and_allowed_tokens_steer_greedy(llm):
    p = prompt(3, 10)
    (forced,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                 logit_bias={77: 100.0}))
    assert forced.outputs[0].token_ids == [77] * 4
    (allowed,) = llm.generate([p], SamplingParams(temperature=0.8, seed=1, max_tokens=8,
                                                  ignore_eos=True, allowed_token_ids=[5, 6]))
    assert set(allowed.outputs[0].token_ids) <= {5, 6}


def test_penalties_and_bias_follow_their_definitions():
    from pagewire.executor.logits_processors import apply_logits_processors
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    tokens, num_prompt = [0, 1, 3, 3, 2], 2          # prompt [0, 1]; generated [3, 3, 2]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25,
                            repetition_penalty=2.0, logit_bias={4: -1.0})
    apply_logits_processors(logits, [params], [(tokens, num_prompt)])
    # repetition (seen: 0,1,2,3): positive / 2, negative * 2; then frequency per generated
    # occurrence, presence once per generated token; bias added to token 4.
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2 - 2 * 0.5 - 0.25, 1.0 - 1.0]
    assert logits[0].tolist() == pytest.approx(expected)


def test_bad_word_bans_only_the_completing_token():
    from pagewire.executor.logits_processors import apply_logits_processors
    params = SamplingParams(bad_words_ids=[[7, 8], [4]])
    for tokens, banned in (([1, 2, 7], {8, 4}), ([1, 2, 5], {4}), ([7], {4})):
        logits = torch.zeros(1, 10)
        apply_logits_processors(logits, [params], [(tokens, 1)])
        assert {i for i in range(10) if logits[0, i] == float("-inf")} == banned, tokens


def test_repetition_penalty_demotes_prompt_tokens(llm):
    p = [9] * 12
    (rep,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                              repetition_penalty=1e6, logit_bias={9: 50.0}))
    assert 9 not in rep.outputs[0].token_ids        # x/1e6 or x*1e6 sinks it whatever its sign


def test_bad_words_are_never_completed(llm, model):
    p = prompt(5, 10)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (free,) = llm.generate([p], params)
    word = llm.tokenizer.decode(free.outputs[0].token_ids[:1])
    (banned,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 bad_words=[word]))
    ids = llm.tokenizer.encode(word, add_special_tokens=False)
    assert banned.outputs[0].token_ids[:len(ids)] != ids


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    p = prompt(6, 30)
    (out,) = llm.generate([p], SamplingParams(max_tokens=1, truncate_prompt_tokens=7))
    assert out.prompt_token_ids == p[-7:]


def test_out_of_vocabulary_ids_are_refused(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([prompt(7, 5)], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([prompt(7, 5)], SamplingParams(allowed_token_ids=[-1]))
    kv = llm.scheduler.kv
    assert kv.num_free == kv.num_blocks
