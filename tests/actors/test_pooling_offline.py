"""LLM.embed, LLM.score and LLM.classify (llm_pooling.py) on tiny causal LMs read as pooling
models: each equals LLM.encode's raw output post-processed by hand, and each refuses the
model that does not serve it, naming the runner."""
from __future__ import annotations

import numpy as np
import pytest

from pagewire.llm import LLM

# the borrowed tokenizer's vocabulary: text prompts encode to any of its ids
VOCAB = 49152
OPTIONS = dict(dtype="float32", kernels="torch", kv_cache_memory=16 << 20, max_model_len=128)


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def test_embed_and_score_with_an_embedding_model(tiny_llama):
    llm = LLM(tiny_llama(vocab_size=VOCAB), convert="embed", **OPTIONS)
    prompts = [[5, 9, 200, 31], [40, 41, 42], "hello there"]
    raw = [o.outputs.data for o in llm.encode(prompts)]
    got = llm.embed(prompts)
    assert [len(o.outputs.embedding) for o in got] == [len(r) for r in raw]
    for o, r in zip(got, raw):
        np.testing.assert_allclose(o.outputs.embedding, _unit(r), rtol=1e-5, atol=1e-6)
    plain = llm.embed([5, 9, 200, 31], normalize=False)[0].outputs.embedding
    np.testing.assert_allclose(plain, raw[0], rtol=1e-6)
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        llm.embed("hi", dimensions=8)
    scores = llm.score("hello there", ["hello there", "goodbye"])
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    goodbye = llm.encode("goodbye")[0].outputs.data
    assert scores[1].outputs.score == pytest.approx(float(_unit(raw[2]) @ _unit(goodbye)),
                                                    abs=1e-5)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(["a", "b"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="task is classify, but this model's is embed"):
        llm.classify("hi")


def test_a_yes_no_reranker_scores_pairs_and_classifies(tiny_llama):
    llm = LLM(tiny_llama(vocab_size=VOCAB), convert="classify",
              pooler_config={"classifier_from_token": ["a", "b"]}, **OPTIONS)
    logits = [float(o.outputs.data[0]) for o in
              llm.encode(["what is x", "what is x"], pairs=["x is one", "no idea"])]
    scores = [o.outputs.score for o in llm.score("what is x", ["x is one", "no idea"])]
    assert scores == pytest.approx([1 / (1 + np.exp(-z)) for z in logits], rel=1e-5)
    raw = llm.score("what is x", "x is one", use_activation=False)[0].outputs.score
    assert raw == pytest.approx(logits[0], rel=1e-5)
    probs = llm.classify(["what is x"])[0].outputs
    assert probs.num_classes == 1
    assert 0.0 < probs.probs[0] < 1.0
    with pytest.raises(ValueError, match="task is embed, but this model's is classify"):
        llm.embed("hi")


def test_a_generating_model_refuses_pooling_calls(tiny_llama):
    llm = LLM(tiny_llama(), **OPTIONS)
    for call in (lambda: llm.embed("hi"), lambda: llm.score("a", "b"),
                 lambda: llm.classify("hi")):
        with pytest.raises(ValueError, match="--runner generate; start it with --runner pooling"):
            call()


def test_a_bert_cross_encoder_scores_and_classifies_as_transformers(tmp_path):
    """Each (query, document) pair is one input with its token types, as transformers
    reads it: sigmoid of the one logit; classify gives the same probability."""
    import torch
    from transformers import BertForSequenceClassification

    from transformers import AutoTokenizer

    from pagewire.testing.tiny_sentence import make_sentence_model
    path = make_sentence_model(str(tmp_path), "BertForSequenceClassification", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    query, docs = "what city is paris", ["paris is a big city", "a cat"]
    hf = BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.sigmoid(hf(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]).item()
                for d in docs]
        alone = torch.sigmoid(hf(**tokenizer("a cat", return_tensors="pt")).logits[0, 0]).item()
    llm = LLM(path, dtype="float32", kernels="torch", max_model_len=64)
    assert [o.outputs.score for o in llm.score(query, docs)] == pytest.approx(want, abs=1e-5)
    assert llm.classify("a cat")[0].outputs.probs == pytest.approx([alone], abs=1e-5)


def test_a_causal_embedder_projects_its_last_token_through_its_dense_module(tiny_llama):
    """ModelRunner's pooled rows: a Dense module (Tanh, saved by sentence-transformers) on the
    last token's state, as the module's own weights give it, then normalised by LLM.embed."""
    import json

    from safetensors.torch import load_file

    from pagewire.testing.tiny_sentence import write_sentence_modules
    path = tiny_llama(vocab_size=VOCAB)
    with open(f"{path}/config.json") as f:
        hidden = json.load(f)["hidden_size"]
    prompts = [[5, 9, 200, 31], [40, 41, 42]]
    raw = np.stack([o.outputs.data for o in LLM(path, convert="embed", **OPTIONS).encode(prompts)])
    write_sentence_modules(path, "lasttoken", width=hidden, dense=((24, "Tanh"),))
    llm = LLM(path, convert="embed", **OPTIONS)
    assert llm.config.model.model_info.pooler.size == 24
    weights = {k: v.numpy().astype(np.float64) for k, v in
               load_file(f"{path}/2_Dense/model.safetensors").items()}
    want = np.tanh(raw @ weights["linear.weight"].T + weights["linear.bias"])
    got = [o.outputs.data for o in llm.encode(prompts)]
    np.testing.assert_allclose(np.stack(got), want, rtol=1e-5, atol=1e-6)
    for o, w in zip(llm.embed(prompts), want):
        np.testing.assert_allclose(o.outputs.embedding, _unit(w), rtol=1e-5, atol=1e-6)


def test_a_dense_module_without_its_weights_is_refused_naming_its_folder(tiny_llama):
    import json
    import os

    from pagewire.testing.tiny_sentence import write_sentence_modules
    path = tiny_llama(vocab_size=VOCAB)
    with open(f"{path}/config.json") as f:
        hidden = json.load(f)["hidden_size"]
    write_sentence_modules(path, "lasttoken", width=hidden, dense=((24, "Identity"),))
    os.remove(f"{path}/2_Dense/model.safetensors")
    with pytest.raises(ValueError, match="2_Dense: the Dense module's weights"):
        LLM(path, convert="embed", **OPTIONS)
