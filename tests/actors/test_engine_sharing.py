"""Sharing features end to end in the offline engine on tiny random-weight models: outputs
must not change because memory is shared, cached, swapped or forked."""
from __future__ import annotations

import random

import pytest
import torch

from pagewire import LLM, SamplingParams
from tests.helpers import HFOracle


def prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.scheduler.kv
    assert kv.num_free == kv.num_blocks and not any(kv.refcount)
    assert not llm.scheduler.requests and not llm.scheduler.groups


@pytest.fixture(scope="module")
def model(tmp_path_factory, smol_tokenizer_dir):
    from tests.helpers import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("m")), smol_tokenizer_dir, "gqa2-d64")


def test_n_sequences_equal_separately_seeded_requests(model):
    llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=512)
    (p,) = prompts(1, [21])
    forked = llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=100, max_tokens=12,
                                              ignore_eos=True))
    alone = [llm.generate([p], SamplingParams(temperature=1.0, seed=100 + j, max_tokens=12,
                                              ignore_eos=True))[0] for j in range(3)]
    assert tokens(forked) == tokens(alone)
    assert len({tuple(t) for t in tokens(forked)}) == 3
    assert_pool_whole(llm)


def test_prefix_caching_changes_nothing_but_the_work(model):
    shared = prompts(2, [40])[0]
    batch = [shared + tail for tail in prompts(3, [3, 9, 17, 1])]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    on = LLM(model, dtype="float32", block_size=8, num_kv_blocks=256)
    off = LLM(model, dtype="float32", block_size=8, num_kv_blocks=256, enable_prefix_caching=False)
    first = on.generate([{"prompt_token_ids": batch[0]}], params)
    rest = on.generate([{"prompt_token_ids": p} for p in batch[1:]], params)
    expected = off.generate([{"prompt_token_ids": p} for p in batch], params)
    assert tokens(first + rest) == tokens(expected)
    assert on.scheduler.tables.prefix_hits == 3 * 40   # 5 full blocks of the prefix, 3 times
    assert off.scheduler.tables.prefix_hits == 0
    assert_pool_whole(on)


def test_swap_preemption_resumes_exactly(model):
    ps = prompts(4, [30, 31, 29, 30])
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)] * 2
    alone = LLM(model, dtype="float32", block_size=4, num_kv_blocks=256)
    expected = [alone.generate([{"prompt_token_ids": p}], sp)[0] for p, sp in zip(ps, params)]
    tight = LLM(model, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=128,
                swap_space=1 << 20, preemption_mode="swap")
    outs = tight.generate([{"prompt_token_ids": p} for p in ps], params)
    assert tight.scheduler.num_preemptions > 0
    assert tokens(outs) == tokens(expected)
    assert_pool_whole(tight)
    host = tight.scheduler.tables.host
    assert host.num_free == host.num_blocks


def test_best_of_keeps_the_most_likely_and_logprobs_are_the_models(model):
    llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=512)
    (p,) = prompts(5, [12])
    (out,) = llm.generate([p], SamplingParams(n=2, best_of=5, temperature=1.0, seed=3,
                                              max_tokens=8, ignore_eos=True))
    (everything,) = llm.generate([p], SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=8,
                                                     ignore_eos=True, logprobs=0))
    ranked = sorted(everything.outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    hf = HFOracle.from_dir(model).model
    with torch.no_grad():
        for c in everything.outputs:
            logits = hf(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None]).sum()
            assert c.cumulative_logprob == pytest.approx(float(lp), abs=1e-3)


def test_beam_search_matches_transformers(model):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=512)
    for p in prompts(6, [7, 19]):
        (out,) = llm.generate([p], SamplingParams(n=2, best_of=4, use_beam_search=True,
                                                  max_tokens=10, ignore_eos=True))
        ref = hf.generate(torch.tensor([p]), num_beams=4, num_return_sequences=2, do_sample=False,
                          max_new_tokens=10, min_new_tokens=10, length_penalty=1.0,
                          early_stopping=False)
        assert [c.token_ids for c in out.outputs] == [r[len(p):].tolist() for r in ref]
    assert_pool_whole(llm)
