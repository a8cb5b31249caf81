"""Encoder models behind the pooling endpoints of a running `pagewire serve`: a tiny random
BertModel with sentence-transformers' files (mean pooling, Normalize) through the openai
client, a tiny BertForSequenceClassification cross-encoder over plain HTTP (/rerank in
Jina's and Cohere's shapes, /score, /classify) and a BertForTokenClassification tagger
(/pooling's token_classify); every value against transformers on the same tokenizer (pairs
with their token types)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.testing.server import openai_client, running_server
from pagewire.testing.tiny_sentence import make_sentence_model

pytestmark = pytest.mark.slow
ARGS = ["--dtype", "float32", "--kernels", "torch", "--max-model-len", "64"]
QUERY = "what city is paris"
DOCS = ["the cat eats fish", "paris is a big city", "a dog runs on the road", "rome"]


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, arch, extra in (("embed", "BertModel", {}),
                              ("rerank", "BertForSequenceClassification", {"num_labels": 1})):
        out[name] = make_sentence_model(str(tmp_path_factory.mktemp(name)), arch, "mean",
                                        **extra)
    return out


def _hf(path: str, arch: str):
    import transformers
    from transformers import AutoTokenizer
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_bert_embeddings_equal_transformers_mean(bert_dirs):
    path = bert_dirs["embed"]
    model, tokenizer = _hf(path, "BertModel")
    texts = [QUERY, *DOCS, ""]             # "" is [CLS] [SEP]: allowed
    with torch.no_grad():               # sentence-transformers' mean over every token
        want = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0].mean(0).numpy()
                for t in texts]
    with running_server([path, *ARGS]) as srv:
        got = openai_client(srv).embeddings.create(model=path, input=texts)
        for served, w in zip(got.data, want):
            np.testing.assert_allclose(served.embedding, w / np.linalg.norm(w), atol=1e-5)
        assert got.usage.prompt_tokens == sum(len(tokenizer(t).input_ids) for t in texts)
        status, body, _ = srv.request("POST", "/score", {"text_1": QUERY, "text_2": DOCS})
        unit = [w / np.linalg.norm(w) for w in want]
        assert [d["score"] for d in body["data"]] == pytest.approx(
            [float(unit[0] @ u) for u in unit[1:5]], abs=1e-5)
        status, body, _ = srv.request("POST", "/v1/completions", {"prompt": "a"})
        assert status == 400 and "--runner pooling" in body["error"]["message"]
        status, body, _ = srv.request("POST", "/pooling", {"input": [QUERY, ""],
                                                           "task": "token_embed"})
        assert status == 200, body
        for served, text in zip(body["data"], [QUERY, ""]):     # every token's state, unit
            with torch.no_grad():
                rows = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            rows = (rows / rows.norm(dim=1, keepdim=True)).numpy()
            np.testing.assert_allclose(served["data"], rows, atol=1e-5)


def test_bert_cross_encoder_reranks_as_transformers(bert_dirs):
    path = bert_dirs["rerank"]
    model, tokenizer = _hf(path, "BertForSequenceClassification")
    with torch.no_grad():
        want = [torch.sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0])
                .item() for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    with running_server([path, *ARGS]) as srv:
        status, jina, _ = srv.request("POST", "/rerank", {"query": QUERY, "documents": DOCS,
                                                          "top_n": 3})
        assert status == 200
        assert [r["index"] for r in jina["results"]] == order[:3]
        assert [r["relevance_score"] for r in jina["results"]] == pytest.approx(
            [want[i] for i in order[:3]], abs=1e-5)
        assert [r["document"]["text"] for r in jina["results"]] == [DOCS[i] for i in order[:3]]
        status, cohere, _ = srv.request("POST", "/v2/rerank", {
            "query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False})
        assert [r["index"] for r in cohere["results"]] == order
        assert cohere["meta"]["billed_units"] == {"search_units": 1}
        status, nn, _ = srv.request("POST", "/score", {"text_1": [QUERY] * 2,
                                                       "text_2": DOCS[:2]})
        assert [d["score"] for d in nn["data"]] == pytest.approx(want[:2], abs=1e-5)
        status, classified, _ = srv.request("POST", "/classify", {"input": DOCS[:1]})
        assert classified["data"][0]["num_classes"] == 1
        assert classified["data"][0]["label"] == "LABEL_0"
        status, body, _ = srv.request("POST", "/v1/embeddings", {"input": "a"})
        assert status == 400 and "this model's is classify" in body["error"]["message"]


def test_a_token_classifier_tags_every_token_as_transformers(tmp_path):
    """vLLM's token_classify on /pooling: every token's logits (probabilities with
    use_activation), as transformers' BertForTokenClassification gives them."""
    path = make_sentence_model(str(tmp_path / "ner"), "BertForTokenClassification", "mean")
    model, tokenizer = _hf(path, "BertForTokenClassification")
    with torch.no_grad():
        want = [model(**tokenizer(t, return_tensors="pt")).logits[0] for t in DOCS[:2]]
    with running_server([path, *ARGS]) as srv:
        status, body, _ = srv.request("POST", "/pooling", {"input": DOCS[:2]})
        assert status == 200, body
        for served, w in zip(body["data"], want):
            np.testing.assert_allclose(served["data"], w.numpy(), atol=1e-5)
        status, body, _ = srv.request("POST", "/pooling", {
            "input": DOCS[0], "task": "token_classify", "use_activation": True})
        np.testing.assert_allclose(body["data"][0]["data"], want[0].softmax(-1).numpy(),
                                   atol=1e-6)
        status, body, _ = srv.request("POST", "/classify", {"input": "a"})
        assert status == 400 and "this model's is token_classify" in body["error"]["message"]


def test_clip_embeds_texts_and_images_through_chat_style_messages(tmp_path):
    """vLLM's chat embeddings: a message of one image part is CLIP's image embedding, a
    message of text its text embedding; both equal the offline engine's, normalised."""
    import base64
    import io

    from PIL import Image

    from pagewire.llm import LLM
    from pagewire.testing.tiny_clip import make_tiny_clip
    path = make_tiny_clip(str(tmp_path / "clip"))
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(40, 50, 3) * 255).astype(np.uint8)).save(
        buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    offline = LLM(path, dtype="float32", kernels="torch")
    want_image = offline.encode({"prompt": "", "multi_modal_data": {"image": buffer.getvalue()}})
    want_text = offline.encode("the cat sat.")
    image_part = {"type": "image_url", "image_url": {"url": url}}
    with running_server([path, *ARGS]) as srv:
        for parts, want in (([image_part], want_image), ([{"type": "text", "text": "the cat sat."}],
                                                         want_text)):
            status, body, _ = srv.request("POST", "/v1/embeddings", {
                "messages": [{"role": "user", "content": parts}]})
            assert status == 200, body
            w = want[0].outputs.data
            np.testing.assert_allclose(body["data"][0]["embedding"], w / np.linalg.norm(w),
                                       atol=1e-5)
        status, body, _ = srv.request("POST", "/v1/embeddings", {"messages": [
            {"role": "user", "content": [image_part, {"type": "text", "text": "a cat"}]}]})
        assert status == 400 and "without text" in body["error"]["message"]
