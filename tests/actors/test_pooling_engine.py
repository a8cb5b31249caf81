"""Pooling requests through the engine's cores (LLM.encode): a causal LM read at its last
token (--convert embed) against transformers, in chunks, from the prefix cache, beside
generation in one batch, and refused where the runner does not serve them."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagewire.llm import LLM
from pagewire.wire.sampling_params import SamplingParams

OPTIONS = dict(dtype="float32", kernels="torch", kv_cache_memory=16 << 20, max_model_len=256)


def _hf_last_states(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """transformers' final (normed) hidden state at each prompt's last token."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in prompts]


def _all_blocks_free(llm: LLM) -> bool:
    kv = llm.scheduler.kv
    return kv.num_free == kv.num_blocks


def test_a_causal_lm_embeds_its_last_tokens_state_whole_chunked_and_cached(tiny_llama):
    path = tiny_llama()
    prompts = [[5, 9, 200, 31, 7], list(range(3, 100)), [17]]
    want = _hf_last_states(path, prompts)
    whole = LLM(path, convert="embed", **OPTIONS)
    assert whole.config.model.model_info.pooler.pooling_type == "LAST"
    got = [o.outputs.data for o in whole.encode(prompts)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    again = whole.encode([prompts[1]])[0].outputs.data          # its blocks are cached now
    assert whole.scheduler.tables.prefix_hits >= 96
    np.testing.assert_allclose(again, want[1], rtol=1e-4, atol=1e-4)
    assert _all_blocks_free(whole)
    assert whole.scheduler.num_generation_tokens == 0
    chunked = LLM(path, convert="embed", max_num_batched_tokens=16, **OPTIONS)
    np.testing.assert_allclose(chunked.encode([prompts[1]])[0].outputs.data, want[1],
                               rtol=1e-4, atol=1e-4)


def test_generation_and_embeddings_share_one_batch(tiny_llama):
    path = tiny_llama()
    llm = LLM(path, runner="generate", convert="embed", **OPTIONS)
    alone_tokens = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].token_ids
    alone_vector = llm.encode([[8, 9, 10, 11]])[0].outputs.data
    gen = llm.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))
    from pagewire.wire.pooling import PoolingInput
    pool = llm.add_request([8, 9, 10, 11], SamplingParams(max_tokens=1), pooling=PoolingInput())
    done = {}
    while len(done) < 2:
        done.update((o.request_id, o) for o in llm.step())
    assert done[gen].outputs[0].token_ids == alone_tokens
    np.testing.assert_allclose(done[pool].pooled, alone_vector, rtol=1e-5, atol=1e-5)
    assert done[pool].outputs[0].finish_reason == "stop"
    assert _all_blocks_free(llm)


def test_each_runner_refuses_the_other_kind_of_request(tiny_llama):
    path = tiny_llama()
    generating = LLM(path, **OPTIONS)
    with pytest.raises(ValueError, match="error"):
        generating.encode([[5, 6]])
    pooling = LLM(path, runner="pooling", **OPTIONS)
    out = pooling.generate([[5, 6]], SamplingParams(max_tokens=3))[0].outputs[0]
    assert out.finish_reason == "error" and out.token_ids == []
    assert _all_blocks_free(pooling) and _all_blocks_free(generating)


def test_a_long_input_is_refused_or_truncated_as_asked(tiny_llama):
    llm = LLM(tiny_llama(), convert="embed", **OPTIONS)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.encode([list(range(3, 300))])
    full = llm.encode([list(range(3, 259))])[0]                # exactly max_model_len
    assert len(full.prompt_token_ids) == 256
    cut = llm.encode([list(range(3, 300))], truncate_prompt_tokens=8)[0]
    assert cut.prompt_token_ids == list(range(3, 11))
    with pytest.raises(ValueError, match="the input is empty"):
        llm.encode([[]])
    assert _all_blocks_free(llm)


def test_a_causal_lm_reranks_from_its_yes_and_no_tokens_logits(tiny_llama):
    """Qwen3-Reranker's way: the score is the "true" token's logit minus the "false" one's
    at the last token, through a sigmoid by default (the gateway's)."""
    from transformers import AutoModelForCausalLM
    path = tiny_llama()
    llm = LLM(path, convert="classify", pooler_config={"classifier_from_token": ["a", "b"]},
              **OPTIONS)
    pooler = llm.config.model.model_info.pooler
    no, yes = pooler.classifier_tokens
    assert (pooler.task, pooler.labels, pooler.activation) == ("classify", ["b"], "sigmoid")
    prompts = [[5, 9, 200, 31, 7], [40, 41]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [(lambda z: float(z[yes] - z[no]))(hf(torch.tensor([p])).logits[0, -1])
                for p in prompts]
    got = [float(o.outputs.data[0]) for o in llm.encode(prompts)]
    assert len(llm.encode(prompts)[0].outputs.data) == 1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not one token"):
        LLM(path, convert="classify", pooler_config={"classifier_from_token": ["no way", "b"]},
            **OPTIONS)


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_a_decoder_classifier_reads_its_score_head_at_the_last_token(tmp_path, family,
                                                                     smol_tokenizer_dir):
    """*ForSequenceClassification over a causal decoder (reward models, rerankers): the
    score head's logits at the last token, as transformers computes them."""
    import shutil
    import transformers
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForSequenceClassification")
    config = config_cls(vocab_size=512, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_labels=3, max_position_embeddings=256,
                        tie_word_embeddings=family == "Qwen3", pad_token_id=0)
    torch.manual_seed(0)
    hf = model_cls(config).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    for name in os.listdir(smol_tokenizer_dir):
        shutil.copy(os.path.join(smol_tokenizer_dir, name), tmp_path)
    llm = LLM(str(tmp_path), **OPTIONS)
    pooler = llm.config.model.model_info.pooler
    assert (pooler.task, pooler.size, pooler.activation) == ("classify", 3, "softmax")
    prompts = [[5, 9, 200, 31, 7], [40, 41, 42]]
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]
    for out, w in zip(llm.encode(prompts), want):
        np.testing.assert_allclose(out.outputs.data, w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(str(tmp_path), runner="generate", **OPTIONS)


def test_a_text_past_the_models_vocabulary_is_refused_not_run(tiny_llama):
    """The borrowed tokenizer is wider than the tiny model's 512 rows: a text that encodes
    past them is a 400 at the tokenizer, for generation and pooling alike."""
    llm = LLM(tiny_llama(), runner="generate", convert="embed", **OPTIONS)
    with pytest.raises(ValueError, match="past the model's vocabulary of 512"):
        llm.generate("Photosynthesis", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"out of range \[0, 512\)"):
        llm.encode("Photosynthesis")
    assert llm.generate("a", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"
