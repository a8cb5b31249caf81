"""The pooling endpoints through a running `pagewire serve`: a tiny random Llama read at its last
token (--convert embed, beside generation under --runner generate) through the openai client,
and the same model as a yes/no reranker (--runner pooling --convert classify) over plain HTTP
in Jina's, Cohere's and vLLM's shapes; hostile inputs refused or truncated as documented."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pagewire.testing.server import openai_client, running_server
from tests.helpers import TINY_SHAPES, make_tiny_llama

pytestmark = pytest.mark.slow
HIDDEN = TINY_SHAPES["gqa2-d64"][0]
ARGS = ["--dtype", "float32", "--kernels", "torch", "--max-model-len", "128",
        "--kv-cache-memory", "32MiB"]
RERANKER = ["--runner", "pooling", "--convert", "classify",
            "--pooler-config", json.dumps({"classifier_from_token": ["a", "b"]})]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_tokenizer_dir) -> str:
    # the borrowed tokenizer's whole vocabulary: text inputs encode to any of its ids
    path = make_tiny_llama(str(tmp_path_factory.mktemp("tiny")), smol_tokenizer_dir,
                           vocab_size=49152)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    with open(f"{path}/config.json", "w") as f:      # trained to be cut to 32 values too
        json.dump({**config, "matryoshka_dimensions": [32, HIDDEN]}, f)
    return path


@pytest.fixture(scope="module")
def embedder(model_dir):
    with running_server([model_dir, *ARGS, "--runner", "generate", "--convert", "embed"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def reranker(model_dir):
    with running_server([model_dir, *ARGS, *RERANKER]) as srv:
        yield srv


def test_openai_client_embeddings_equal_the_offline_ones(embedder, model_dir):
    from pagewire.llm import LLM
    client = openai_client(embedder)
    texts = ["The capital of France is Paris.", "pagewire serves embeddings", "x"]
    got = client.embeddings.create(model=model_dir, input=texts)   # the client asks base64
    assert [d.index for d in got.data] == [0, 1, 2]
    assert got.usage.prompt_tokens == got.usage.total_tokens > 3
    offline = LLM(model_dir, dtype="float32", kernels="torch", max_model_len=128,
                  kv_cache_memory=16 << 20, convert="embed").embed(texts)
    for served, want in zip(got.data, offline):
        assert len(served.embedding) == HIDDEN
        np.testing.assert_allclose(served.embedding, want.outputs.embedding, atol=1e-5)
        assert np.linalg.norm(served.embedding) == pytest.approx(1.0, abs=1e-5)
    floats = client.embeddings.create(model=model_dir, input="x", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, got.data[2].embedding, atol=1e-6)
    cut = client.embeddings.create(model=model_dir, input="x", dimensions=32).data[0].embedding
    want = offline[2].outputs.embedding[:32]
    np.testing.assert_allclose(cut, np.array(want) / np.linalg.norm(want), atol=1e-5)


def test_generation_and_embeddings_on_one_server_at_once(embedder, model_dir):
    from concurrent.futures import ThreadPoolExecutor
    client = openai_client(embedder)

    def generate(i: int):
        return client.completions.create(model=model_dir, prompt=f"hello {i}", max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})

    def embed(i: int):
        return embedder.request("POST", "/v1/embeddings", {"input": [[5, 9, 31 + i]] * 4})

    with ThreadPoolExecutor(8) as pool:
        texts = [pool.submit(generate, i) for i in range(4)]
        vectors = [pool.submit(embed, i) for i in range(4)]
        assert all(t.result().usage.completion_tokens == 8 for t in texts)
        for v in vectors:
            status, body, _ = v.result()
            assert status == 200 and [len(d["embedding"]) for d in body["data"]] == [HIDDEN] * 4
    assert embedder.kv_blocks_freed()


def test_hostile_embedding_inputs_are_refused_or_truncated(embedder, model_dir):
    import openai
    client = openai_client(embedder)
    with pytest.raises(openai.BadRequestError, match=r"dimensions=8 is not one of .*\[32, 128\]"):
        client.embeddings.create(model=model_dir, input="x", dimensions=8)
    status, body, _ = embedder.request("POST", "/v1/embeddings", {"input": ["x"] * 10_000})
    assert status == 400 and "at most 2048 entries, got 10000" in body["error"]["message"]
    long = list(range(3, 203))                                 # 200 tokens, context 128
    status, body, _ = embedder.request("POST", "/v1/embeddings", {"input": long})
    assert status == 400 and "maximum context length is 128" in body["error"]["message"]
    status, body, _ = embedder.request("POST", "/v1/embeddings",
                                       {"input": long, "truncate_prompt_tokens": 16})
    assert status == 200 and body["usage"]["prompt_tokens"] == 16
    status, body, _ = embedder.request("POST", "/v1/embeddings", {"input": ["", "x"]})
    # this tokenizer adds no special tokens: an empty string encodes to nothing, refused
    assert status == 400 and "the input is empty" in body["error"]["message"]
    status, body, _ = embedder.request("POST", "/classify", {"input": "x"})
    assert status == 400 and "this model's is embed" in body["error"]["message"]


def test_ollama_client_embeds(embedder, model_dir):
    import ollama
    client = ollama.Client(host=embedder.url)
    got = client.embed(model=model_dir, input=["x", "y z"])
    assert len(got.embeddings) == 2 and len(got.embeddings[0]) == HIDDEN
    status, body, _ = embedder.request("POST", "/v1/embeddings", {"input": "x",
                                                                  "encoding_format": "float"})
    np.testing.assert_allclose(got.embeddings[0], body["data"][0]["embedding"], atol=1e-6)
    assert "embedding" in client.show(model_dir).capabilities


def test_a_batch_line_asks_for_embeddings(embedder):
    import asyncio
    from pagewire.batch_lines import read_requests, run_requests
    lines = read_requests(json.dumps({"custom_id": "e1", "method": "POST",
                                      "url": "/v1/embeddings", "body": {"input": "x"}}))
    out: list[dict] = []
    asyncio.run(run_requests(embedder.url, lines, out.append, concurrency=1))
    (answer,) = out
    assert answer["custom_id"] == "e1" and answer["response"]["status_code"] == 200
    assert len(answer["response"]["body"]["data"][0]["embedding"]) == HIDDEN


def test_score_of_an_embedding_model_is_cosine(embedder):
    status, body, _ = embedder.request("POST", "/v1/score", {"text_1": "x",
                                                             "text_2": ["x", "y z"]})
    assert status == 200
    assert body["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert -1.0 <= body["data"][1]["score"] < 1.0


def test_reranker_in_jina_cohere_and_vllm_shapes(reranker, model_dir):
    query, docs = "what is x", ["x is one", "no idea", "x is two"]
    status, jina, _ = reranker.request("POST", "/v1/rerank", {"query": query, "documents": docs,
                                                              "top_n": 2})
    assert status == 200 and len(jina["results"]) == 2
    status, score, _ = reranker.request("POST", "/score", {"text_1": query, "text_2": docs})
    scores = [d["score"] for d in score["data"]]
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in jina["results"]] == order
    assert [r["document"]["text"] for r in jina["results"]] == [docs[i] for i in order]
    assert [r["relevance_score"] for r in jina["results"]] == pytest.approx(
        [scores[i] for i in order], abs=1e-6)
    status, cohere, _ = reranker.request("POST", "/v2/rerank", {
        "query": query, "documents": docs, "return_documents": False})
    assert status == 200 and "meta" in cohere and "document" not in cohere["results"][0]
    assert all(0.0 < s < 1.0 for s in scores)
    status, classified, _ = reranker.request("POST", "/classify", {"input": ["x", "y"]})
    assert status == 200 and classified["data"][0]["num_classes"] == 1
    assert classified["data"][0]["label"] == "b"


def test_a_pooling_server_refuses_generation_naming_the_runner(reranker, model_dir):
    import openai
    client = openai_client(reranker)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.completions.create(model=model_dir, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.chat.completions.create(model=model_dir, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    status, body, _ = reranker.request("POST", "/v1/embeddings", {"input": "x"})
    assert status == 400 and "this model's is classify" in body["error"]["message"]
