"""Encoder-only pooling models through the engine (LLM.encode, PoolingRunner) against
sentence-transformers on the same files: embeddings (its pooling module, Dense projections
and Normalize), a
cross-encoder's scores on (query, document) pairs, on torch ops and every CPU tier."""
from __future__ import annotations

import numpy as np
import pytest

from pagewire.kernels import tiers
from pagewire.llm import LLM
from pagewire.testing.tiny_sentence import make_sentence_model

TEXTS = ["the cat runs in the house", "paris is a big city", "what", "",
         "the old dog sleeps on the road and the bird flies to the tree " * 2]
KERNELS = ["torch", *tiers.TIERS]


def _engine(path: str, kernels: str, **options) -> LLM:
    if kernels != "torch" and kernels not in tiers.runnable():
        pytest.skip(f"this CPU does not run the {kernels} tier")
    dtype = "float32" if kernels == "torch" else "bfloat16"
    return LLM(path, dtype=dtype, kernels=kernels, **options)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    return (a * (b / np.linalg.norm(b, axis=1, keepdims=True))).sum(1)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("architecture, pooling", [("BertModel", "mean"),
                                                   ("XLMRobertaModel", "cls"),
                                                   ("MPNetModel", "mean")])
def test_embeddings_match_sentence_transformers(tmp_path, kernels, architecture, pooling):
    from sentence_transformers import SentenceTransformer
    path = make_sentence_model(str(tmp_path), architecture, pooling)
    want = SentenceTransformer(path, device="cpu").encode(TEXTS)
    llm = _engine(path, kernels, max_num_seqs=3)         # five prompts over several steps
    pooler = llm.config.model.model_info.pooler
    assert (pooler.pooling_type, pooler.normalize, pooler.encoder_only) == \
        (pooling.upper(), True, True)
    got = np.stack([o.outputs.data for o in llm.encode(TEXTS)])
    bound = 1 - 1e-6 if kernels == "torch" else 0.999
    assert (_cosines(got, want) > bound).all(), _cosines(got, want)
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks
    assert not llm.config.cache.enable_prefix_caching


@pytest.mark.parametrize("kernels", ["torch", "avx2"])
def test_dense_modules_project_as_sentence_transformers_does(tmp_path, kernels):
    """Two Dense modules after mean pooling (128 -> 96 Tanh, no bias, an older pickled
    save; 96 -> 48 GELU), then Normalize: the embedding is the last one's 48 values."""
    from sentence_transformers import SentenceTransformer
    path = make_sentence_model(str(tmp_path), "BertModel", "mean",
                               dense=((96, "Tanh", False), (48, "GELU")))
    want = SentenceTransformer(path, device="cpu").encode(TEXTS)
    llm = _engine(path, kernels, max_num_seqs=3)
    pooler = llm.config.model.model_info.pooler
    assert (pooler.size, [d.activation for d in pooler.dense]) == (48, ["tanh", "gelu"])
    got = np.stack([o.outputs.data for o in llm.encode(TEXTS)])
    embedded = np.stack([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert got.shape == embedded.shape == want.shape == (len(TEXTS), 48)
    bound = 1 - 1e-6 if kernels == "torch" else 0.999
    assert (_cosines(got, want) > bound).all(), _cosines(got, want)
    assert (_cosines(embedded, want) > bound).all(), _cosines(embedded, want)
    np.testing.assert_allclose(np.linalg.norm(embedded, axis=1), 1, rtol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "avx512_bf16"])
def test_a_cross_encoder_scores_pairs_as_sentence_transformers_does(tmp_path, kernels):
    from sentence_transformers import CrossEncoder
    path = make_sentence_model(str(tmp_path), "BertForSequenceClassification", num_labels=1)
    query = "where does the cat sleep"
    docs = ["the cat sleeps in the house", "paris is big", "the dog runs", "the cat"]
    want = CrossEncoder(path, device="cpu").predict([(query, d) for d in docs])
    llm = _engine(path, kernels)
    assert llm.config.model.model_info.pooler.activation == "sigmoid"
    logits = np.array([o.outputs.data[0] for o in llm.encode([query] * len(docs), pairs=docs)])
    got = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(got, want, atol=1e-5 if kernels == "torch" else 2e-2)
    assert list(np.argsort(-got)) == list(np.argsort(-want))


def test_a_long_input_is_refused_or_truncated_keeping_its_special_tokens(tmp_path):
    path = make_sentence_model(str(tmp_path), "BertModel")
    llm = LLM(path, dtype="float32", kernels="torch")
    assert llm.config.model.max_model_len == 64
    long = "the cat runs " * 40
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.encode([long])
    out = llm.encode([long], truncate_prompt_tokens=10)[0]
    cls, sep = llm.tokenizer.cls_token_id, llm.tokenizer.sep_token_id
    assert len(out.prompt_token_ids) == 10
    assert (out.prompt_token_ids[0], out.prompt_token_ids[-1]) == (cls, sep)
    whole = llm.encode([long], truncate_prompt_tokens=-1)[0]
    assert len(whole.prompt_token_ids) == 64
    empty = llm.encode([""])[0]
    assert empty.prompt_token_ids == [cls, sep]


def test_an_encoder_rounded_to_int8_blocks_stays_close(tmp_path):
    """--quantization int8: the encoder's Linears as Q8_0 blocks, multiplied with int8
    activations where asked (VNNI: ~1.4x the bfloat16 rate on an MPNet-base batch here)."""
    from sentence_transformers import SentenceTransformer
    path = make_sentence_model(str(tmp_path), "BertModel")
    want = SentenceTransformer(path, device="cpu").encode(TEXTS)
    tier = "avx512_bf16" if "avx512_bf16" in tiers.runnable() else "avx2"
    llm = _engine(path, tier, quantization="int8", quantized_activations="int8-all")
    assert llm.config.device.quantized_matmul_tokens == -1
    got = np.stack([o.outputs.data for o in llm.encode(TEXTS)])
    assert (_cosines(got, want) > 0.995).all(), _cosines(got, want)
