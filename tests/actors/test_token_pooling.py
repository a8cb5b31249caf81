"""Per-token pooling (vLLM's token_embed) through the engine's cores, LLM.encode(pooling_task=
"token_embed"): every prompt token's final hidden state, normalised as the model's pooler says,
against transformers' last_hidden_state: a tiny BERT (whole prompts, PoolingRunner) and a tiny
Llama under --convert embed with prompts longer than the token budget (chunked prefill: every
chunk's rows, in order), never served from the prefix cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.llm import LLM
from pagewire.wire.pooling import PoolingInput
from pagewire.wire.sampling_params import SamplingParams
from pagewire.testing.tiny_sentence import make_sentence_model

TEXTS = ["the cat runs in the house", "paris", "the old dog sleeps on the road " * 3]


def _unit_rows(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def _hf_rows(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """transformers' last_hidden_state of every token of each prompt, row-normalised."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [_unit_rows(model(torch.tensor([p])).last_hidden_state[0].numpy())
                for p in prompts]


def _check_rows(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert ((got * want).sum(1) > 1 - 1e-6).all()            # cosine per token
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_bert_returns_every_tokens_hidden_state(tmp_path):
    path = make_sentence_model(str(tmp_path), "BertModel", "mean")
    llm = LLM(path, dtype="float32", kernels="torch", max_num_seqs=2)   # over several steps
    outs = llm.encode(TEXTS, pooling_task="token_embed")
    want = _hf_rows(path, [o.prompt_token_ids for o in outs])
    assert [len(o.prompt_token_ids) for o in outs] == [8, 3, 23]
    for out, rows in zip(outs, want):
        _check_rows(out.outputs.data, rows)
    assert llm.encode(TEXTS[:1], pooling_task="embed")[0].outputs.data.shape == (128,)
    for task, what in (("token_classify", "a \\*ForTokenClassification model serves it"),
                       ("classify", "it serves embed, token_embed")):
        with pytest.raises(ValueError, match=what):
            llm.encode(TEXTS[:1], pooling_task=task)
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks


def test_dense_modules_project_every_token_as_vllm_does(tmp_path):
    """sentence-transformers' Dense modules (128 -> 48 Tanh) applied to each token's state,
    then Normalize, as vLLM's token_embed head does (sentence-transformers' own
    token_embeddings stop before them)."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel
    path = make_sentence_model(str(tmp_path), "BertModel", "mean", dense=((48, "Tanh"),))
    dense = SentenceTransformer(path, device="cpu")[2]
    llm = LLM(path, dtype="float32", kernels="torch")
    out = llm.encode(TEXTS[:1], pooling_task="token_embed")[0]
    with torch.no_grad():
        states = AutoModel.from_pretrained(path, dtype=torch.float32).eval()(
            torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        rows = dense.activation_function(dense.linear(states)).numpy()
    _check_rows(out.outputs.data, _unit_rows(rows))


def test_a_causal_lm_gathers_every_chunks_rows_and_skips_the_prefix_cache(tiny_llama):
    path = tiny_llama()
    prompts = [list(range(3, 100)), [5, 9, 200, 31, 7], list(range(40, 90))]
    want = _hf_rows(path, prompts)
    llm = LLM(path, convert="embed", dtype="float32", kernels="torch",
              kv_cache_memory=16 << 20, max_model_len=256, max_num_batched_tokens=16)
    last = llm.encode(prompts[:1])[0].outputs.data               # caches its blocks
    np.testing.assert_allclose(last / np.linalg.norm(last), want[0][-1], atol=1e-5)
    hits = llm.scheduler.tables.prefix_hits
    outs = llm.encode(prompts, pooling_task="token_embed")       # 97 tokens: seven chunks
    assert llm.scheduler.tables.prefix_hits == hits              # every position computed
    for out, rows in zip(outs, want):
        _check_rows(out.outputs.data, rows)
    # one batch: a last-token embedding beside a per-token one (each its own output)
    one = llm.add_request({"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=1),
                          pooling=PoolingInput())
    every = llm.add_request({"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=1),
                            pooling=PoolingInput(per_token=True))
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o.pooled for o in llm.step()})
    np.testing.assert_allclose(done[one], want[1][-1] * np.linalg.norm(done[one]), atol=1e-5)
    assert done[every].shape == (want[1].size,)                   # the raw rows, flat
    np.testing.assert_allclose(_unit_rows(done[every].reshape(want[1].shape)), want[1],
                               atol=1e-5)
    kv = llm.scheduler.kv
    assert kv.num_free == kv.num_blocks and llm.scheduler.num_generation_tokens == 0


def test_a_preempted_token_embed_prompt_is_recomputed_not_swapped(tiny_llama):
    """A generation and a chunked token_embed prompt outgrow the pool: the prompt, admitted
    last, is preempted partway; under --preemption-mode swap it still recomputes (its rows so
    far were the executor's), and every row comes back."""
    path = tiny_llama()
    prompt = list(range(40, 100))
    want = _hf_rows(path, [prompt])[0]
    llm = LLM(path, runner="generate", convert="embed", dtype="float32", kernels="torch",
              block_size=4, num_kv_blocks=25, max_num_batched_tokens=16, max_model_len=96,
              preemption_mode="swap", swap_space=1 << 20)
    llm.add_request({"prompt_token_ids": list(range(3, 43))},
                    SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0))
    out = llm.encode([prompt], pooling_task="token_embed")[0]
    assert llm.scheduler.num_preemptions > 0
    _check_rows(out.outputs.data, want)
