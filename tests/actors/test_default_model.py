"""The embedded SmolLM2-135M-Instruct: our greedy answers equal transformers' on the same
dequantized GGUF weights (float32 on both sides), all prompts batched together and one
alone. Decode steps multiply the file's Q4_1/Q8_0 blocks as stored (kernels/quant.py)."""
from __future__ import annotations

import pytest

from pagewire import LLM, SamplingParams
from tests.helpers import HFOracle, assert_greedy_equal

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to cook.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 * 2**20)


@pytest.fixture(scope="module")
def oracle(default_hf_model):
    return HFOracle(default_hf_model)


def test_chat_answers_match_transformers(llm, oracle):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.chat(conversations, params)
    for question, out in zip(QUESTIONS, outputs):
        theirs, logits = oracle.greedy(out.prompt_token_ids, 20)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, question)
    assert "Paris" in outputs[0].outputs[0].text


def test_single_streams_match_transformers(llm, oracle):
    model = llm.runner.model
    assert all(m.quantized is not None for m in (model.lm_head, model.layers[0].attn.qkv,
                                                 model.layers[29].mlp.down))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for question in QUESTIONS[1:3]:
        (out,) = llm.chat([{"role": "user", "content": question}], params)
        theirs, logits = oracle.greedy(out.prompt_token_ids, 24)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, question)


def test_each_tier_matches_transformers(tier, oracle):
    """The same answers on every native tier this CPU runs, each with its own kernels for the
    blocks (int16 activations on avx2 and avx512; on avx2, where this core's int16 products
    outrun its FMAs, the prompts too go through the blocks' GEMM)."""
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 * 2**20, kernels=tier)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[3:5]]
    for question, out in zip(QUESTIONS[3:5], llm.chat(conversations, params)):
        theirs, logits = oracle.greedy(out.prompt_token_ids, 16)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{tier}: {question}")


def test_eos_ends_the_answer(llm):
    (out,) = llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                      SamplingParams(temperature=0, max_tokens=64))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == "The capital of France is Paris."


def test_ngram_speculation_keeps_the_greedy_answers(oracle):
    spec = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 * 2**20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "max_batch": 8})
    text = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn."
    asks = [f"Repeat this sentence exactly, twice: {text}", QUESTIONS[2]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for ask, out in zip(asks, spec.chat([[{"role": "user", "content": a}] for a in asks],
                                        params)):
        theirs, logits = oracle.greedy(out.prompt_token_ids, 40)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, ask)
    drafts = spec.scheduler.drafts
    assert drafts.num_accepted_tokens > 10            # the repeated sentence is drafted
