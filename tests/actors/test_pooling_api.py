"""The pooling endpoints' post-processing (pooling_outputs.py) and request bodies
(gateway/pooling_api.py), on hand-made vectors: exact values, no engine."""
from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest

from pagewire.gateway.pooling_api import (MAX_POOLING_INPUTS, EmbeddingBody, RerankBody,
                                          ScoreBody, classify_data, pooling_inputs,
                                          rerank_answer, rerank_texts, score_texts)
from pagewire.gateway.protocol import ApiError
from pagewire.pooler_info import PoolerInfo
from pagewire.pooling_outputs import (activate, check_dimensions, check_task, cosine,
                                      cross_score, embedding, encoded, probabilities)
from pagewire.wire.sampling_params import InvalidParam

EMBED = PoolerInfo(task="embed", pooling_type="CLS", size=4, normalize=True,
                   matryoshka_dimensions=[2, 4])
PLAIN = PoolerInfo(task="embed", pooling_type="MEAN", size=4)
RERANKER = PoolerInfo(task="classify", pooling_type="CLS", size=1, labels=["LABEL_0"],
                      activation="sigmoid")
SENTIMENT = PoolerInfo(task="classify", pooling_type="CLS", size=3,
                       labels=["neg", "neu", "pos"], activation="softmax")


def test_embedding_truncates_then_normalizes_as_asked():
    raw = np.array([3.0, 4.0, 12.0, 0.0], dtype=np.float32)
    assert embedding(EMBED, raw).tolist() == pytest.approx([3 / 13, 4 / 13, 12 / 13, 0.0])
    assert embedding(EMBED, raw, dimensions=2).tolist() == pytest.approx([0.6, 0.8])
    assert embedding(EMBED, raw, normalize=False).tolist() == [3.0, 4.0, 12.0, 0.0]
    assert embedding(PLAIN, raw).tolist() == [3.0, 4.0, 12.0, 0.0]      # the model's default
    assert embedding(PLAIN, raw, 2, normalize=True).tolist() == pytest.approx([0.6, 0.8])
    assert embedding(EMBED, np.zeros(4, np.float32)).tolist() == [0.0] * 4
    assert embedding(EMBED, raw).dtype == np.float32


def test_dimensions_must_be_a_matryoshka_size():
    check_dimensions(EMBED, None)
    check_dimensions(EMBED, 2)
    with pytest.raises(InvalidParam, match=r"dimensions=3 is not one of .*\[2, 4\]"):
        check_dimensions(EMBED, 3)
    with pytest.raises(InvalidParam, match="does not support Matryoshka") as e:
        check_dimensions(PLAIN, 4)
    assert e.value.param == "dimensions"


def test_activations_exact():
    assert activate(np.array([0.0]), "sigmoid").tolist() == [0.5]
    assert activate(np.array([np.log(3.0)]), "sigmoid").tolist() == pytest.approx([0.75])
    assert activate(np.array([0.0, np.log(3.0)]), "softmax").tolist() == pytest.approx([0.25, 0.75])
    assert activate(np.array([1000.0, 0.0]), "softmax").tolist() == [1.0, 0.0]   # no overflow
    assert activate(np.array([2.5, -1.0]), "none").tolist() == [2.5, -1.0]
    logits = np.array([0.0, 0.0, np.log(2.0)])
    assert probabilities(SENTIMENT, logits).tolist() == pytest.approx([0.25, 0.25, 0.5])
    assert probabilities(SENTIMENT, logits, False).tolist() == pytest.approx(logits.tolist())


def test_scores_cosine_and_cross_encoder():
    assert cosine([1.0, 0.0], [1.0, 1.0]) == pytest.approx(2 ** -0.5)
    assert cosine([1.0, 2.0], [-2.0, -4.0]) == pytest.approx(-1.0)
    assert cosine([0.0, 0.0], [1.0, 1.0]) == 0.0
    assert cross_score(RERANKER, np.array([0.0])) == 0.5
    assert cross_score(RERANKER, np.array([1.5]), use_activation=False) == 1.5
    two = PoolerInfo(task="classify", pooling_type="CLS", size=2, labels=["no", "yes"],
                     activation="softmax")
    assert cross_score(two, np.array([0.0, np.log(3.0)])) == pytest.approx(0.75)


def test_base64_is_float32_little_endian_as_openai_decodes_it():
    text = encoded(np.array([1.0, -2.5], np.float32), "base64")
    assert np.frombuffer(base64.b64decode(text), dtype="<f4").tolist() == [1.0, -2.5]
    assert encoded(np.array([0.5], np.float32)) == [0.5]
    with pytest.raises(InvalidParam, match="encoding_format must be one of float, base64, "
                                           "bytes, bytes_only"):
        encoded(np.zeros(1), "binary")


def test_tasks_refused_naming_the_runner():
    with pytest.raises(InvalidParam, match="--runner generate; start it with --runner pooling"):
        check_task(None, None, "/score")
    with pytest.raises(InvalidParam, match="task is embed, but this model's is classify"):
        check_task(RERANKER, "embed", "/v1/embeddings")
    with pytest.raises(InvalidParam, match="task is classify, but this model's is embed"):
        check_task(EMBED, "classify", "/classify")
    assert check_task(RERANKER, None, "/rerank") is RERANKER


def test_inputs_each_become_one_prompt():
    assert pooling_inputs("a") == [{"prompt": "a"}]
    assert pooling_inputs(["a", ""]) == [{"prompt": "a"}, {"prompt": ""}]
    assert pooling_inputs([1, 2, 3]) == [{"prompt_token_ids": [1, 2, 3]}]
    assert pooling_inputs([[1], [2, 3]]) == [{"prompt_token_ids": [1]},
                                             {"prompt_token_ids": [2, 3]}]
    assert pooling_inputs(["a", [7]]) == [{"prompt": "a"}, {"prompt_token_ids": [7]}]
    for bad, message in (([], "must not be an empty list"), (["a", 1], "must be a string"),
                         (["x"] * (MAX_POOLING_INPUTS + 1), "at most 2048 entries, got 2049")):
        with pytest.raises(ApiError, match=message) as e:
            pooling_inputs(bad)
        assert (e.value.status, e.value.param) == (400, "input")
    assert len(pooling_inputs(["x"] * MAX_POOLING_INPUTS)) == MAX_POOLING_INPUTS


def test_bodies_decode_with_vllm_field_names():
    body = msgspec.json.decode(b'{"input": ["a"], "model": "m", "user": "u", "dimensions": 2, '
                               b'"encoding_format": "base64", "use_activation": false, '
                               b'"extra": 1}', type=EmbeddingBody)
    assert (body.dimensions, body.encoding_format, body.wants_normalized()) == (2, "base64", False)
    assert EmbeddingBody(input="a", normalize=True, use_activation=False).wants_normalized()
    score = msgspec.json.decode(b'{"text_1": "q", "text_2": ["a", "b"], "activation": false}',
                                type=ScoreBody)
    assert score.activation_asked() is False
    rerank = msgspec.json.decode(b'{"query": "q", "documents": ["a", {"text": "b"}]}',
                                 type=RerankBody)
    assert rerank_texts(rerank) == (["q"], ["a", "b"])


def test_score_texts_are_one_to_n_or_n_to_n():
    assert score_texts("q", ["a", "b"]) == (["q"], ["a", "b"])
    assert score_texts(["q"], "a") == (["q"], ["a"])
    assert score_texts(["q", "r"], ["a", "b"]) == (["q", "r"], ["a", "b"])
    with pytest.raises(ApiError, match="1:1, 1:N or N:N; got 2:3"):
        score_texts(["q", "r"], ["a", "b", "c"])
    with pytest.raises(ApiError, match="text_2 must not be an empty list"):
        score_texts("q", [])
    with pytest.raises(ApiError, match="top_n must be positive"):
        rerank_texts(RerankBody(query="q", documents=["a"], top_n=-1))
    with pytest.raises(ApiError, match="documents must not be an empty list"):
        rerank_texts(RerankBody(query="q", documents=[]))


def test_rerank_sorted_cut_and_shaped_per_api():
    body = RerankBody(query="q", documents=["a", "b", "c"], top_n=2)
    answer = rerank_answer("rerank-1", "m", body, [0.1, 0.9, 0.5], 12)
    assert answer == {"id": "rerank-1", "model": "m",
                      "usage": {"prompt_tokens": 12, "total_tokens": 12},
                      "results": [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
                                  {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}}]}
    body = RerankBody(query="q", documents=["a", "b"], return_documents=False, top_n=0)
    cohere = rerank_answer("r", "m", body, [0.5, 0.5], 3, cohere=True)
    assert cohere["results"] == [{"index": 0, "relevance_score": 0.5},
                                 {"index": 1, "relevance_score": 0.5}]
    assert cohere["meta"] == {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}


def test_classify_data_names_the_most_likely_label():
    assert classify_data([[0.2, 0.7, 0.1], [0.9, 0.05, 0.05]], ["neg", "neu", "pos"]) == [
        {"index": 0, "label": "neu", "probs": [0.2, 0.7, 0.1], "num_classes": 3},
        {"index": 1, "label": "neg", "probs": [0.9, 0.05, 0.05], "num_classes": 3}]
    assert classify_data([[0.1, 0.3]], [])[0]["label"] == "LABEL_1"
