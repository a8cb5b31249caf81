"""The pooling routes on a real Gateway app over a fake engine: a tokenizer channel that answers
each TokenizeRequest at once with a pooled vector made from its text (or refuses it), and a
scheduler channel that records aborts. Exact response bodies, refusals, and the abort of
inputs still running when one fails."""
from __future__ import annotations

import asyncio
import base64
import tempfile

import aiohttp
import msgspec
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagewire.config import EngineConfig
from pagewire.pooler_info import PoolerInfo
from pagewire.wire.channels import ipc_address
from pagewire.wire.ids import SeqId
from pagewire.wire.pooling import to_bytes
from pagewire.wire.to_gateway import RequestFailed, TextDelta
from tests.actors.sched_helpers import make_scheduler

EMBED = PoolerInfo(task="embed", pooling_type="CLS", size=3, normalize=True,
                   matryoshka_dimensions=[2, 3])
RERANKER = PoolerInfo(task="classify", pooling_type="CLS", size=1, labels=["LABEL_0"],
                      activation="sigmoid")
SENTIMENT = PoolerInfo(task="classify", pooling_type="CLS", size=2, labels=["neg", "pos"],
                       activation="softmax")
TAGGER = PoolerInfo(task="token_classify", pooling_type="ALL", size=3, labels=["O", "B", "I"],
                    activation="softmax", encoder_only=True)
VECTORS = {"a": [3.0, 4.0, 0.0], "b": [0.0, 0.0, 2.0], "c": [3.0, 4.0, 12.0], "": [1.0, 0.0, 0.0]}


class FakeTokenizers:
    """Answers each TokenizeRequest on the gateway's routes as the engine would: a final
    delta with the text's vector (a pair's: [len(query) - len(document)] as its logit), or a
    RequestFailed for the text "refuse". Texts starting "slow" are never answered."""

    def __init__(self, gateway):
        self.gateway, self.sent = gateway, []

    def send(self, req) -> None:
        self.sent.append(req)
        if req.prompt == "refuse":
            reply = RequestFailed(req_id=req.req_id, status=400, message="too long",
                                  param="input")
        elif req.prompt is not None and req.prompt.startswith("slow"):
            return
        else:
            reply = TextDelta(SeqId(req.req_id, 0), "", num_prompt_tokens=2,
                              num_output_tokens=0, finish_reason="stop",
                              pooled=to_bytes(self.vector(req)))
        key = req.req_id if isinstance(reply, RequestFailed) else reply.seq_id
        asyncio.get_running_loop().call_soon(self.gateway.routes[key].put_nowait, reply)

    @staticmethod
    def vector(req) -> list[float]:
        if req.pooling.per_token:          # token_embed: two tokens, the text's vector twice
            return VECTORS.get(req.prompt, [0.0, 1.0, 0.0]) * 2
        if req.pooling.pair is not None:
            return [float(len(req.prompt) - len(req.pooling.pair))]
        if req.prompt_token_ids is not None:
            return [float(t) for t in req.prompt_token_ids]
        return VECTORS.get(req.prompt, [0.0, 1.0, 0.0])


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def serve(pooler: PoolerInfo | None, check, **options):
    """Run check(client, gateway) against a Gateway whose model has this pooler."""
    from pagewire.gateway.server import Gateway

    async def main():
        with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
            info = msgspec.structs.replace(make_scheduler().config.model.model_info,
                                           pooler=pooler)
            config = EngineConfig.from_options(model_info=info, num_kv_blocks=16, block_size=4,
                                               run_dir=run_dir, served_model_name="tiny",
                                               **options).resolve()
            gateway = Gateway(config, lambda name: ipc_address(run_dir, name))
            gateway.tokenizers, gateway.scheduler = FakeTokenizers(gateway), Recorder()
            # (aiohttp's test server cancels a handler whose client is gone, as the gateway
            # actor's runner does: handler_cancellation=True)
            async with TestClient(TestServer(gateway.app)) as client:
                await check(client, gateway)
    asyncio.run(main())


async def post(client, path: str, body: dict, status: int = 200) -> dict:
    r = await client.post(path, json=body)
    answer = await r.json()
    assert r.status == status, answer
    return answer


def test_embeddings_normalised_cut_and_base64():
    async def check(client, gateway):
        a = await post(client, "/v1/embeddings", {"input": ["a", "c"], "model": "tiny"})
        assert a["object"] == "list" and a["model"] == "tiny" and a["id"].startswith("embd-")
        assert [d["index"] for d in a["data"]] == [0, 1]
        assert a["data"][0]["object"] == "embedding"
        assert a["data"][0]["embedding"] == pytest.approx([0.6, 0.8, 0.0])
        assert a["data"][1]["embedding"] == pytest.approx([3 / 13, 4 / 13, 12 / 13])
        assert a["usage"] == {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0}
        cut = await post(client, "/v1/embeddings", {"input": "c", "dimensions": 2})
        assert cut["data"][0]["embedding"] == pytest.approx([0.6, 0.8])
        raw = await post(client, "/v1/embeddings", {"input": "c", "normalize": False,
                                                    "encoding_format": "base64"})
        data = base64.b64decode(raw["data"][0]["embedding"])
        assert np.frombuffer(data, "<f4").tolist() == [3.0, 4.0, 12.0]
        ids = await post(client, "/v1/embeddings", {"input": [[3, 4], [5]], "normalize": False})
        assert [d["embedding"] for d in ids["data"]] == [[3.0, 4.0], [5.0]]
        sent = gateway.tokenizers.sent[-1]
        assert (sent.prompt_token_ids, sent.sampling.max_tokens) == ([5], 1)
        empty = await post(client, "/v1/embeddings", {"input": ""})       # allowed
        assert empty["data"][0]["embedding"] == [1.0, 0.0, 0.0]
    serve(EMBED, check)


def test_embeddings_as_bytes_with_metadata_in_any_dtype_and_order():
    async def check(client, gateway):
        r = await client.post("/v1/embeddings", json={
            "input": ["a", "c"], "normalize": False, "encoding_format": "bytes",
            "embed_dtype": "float16", "endianness": "big"})
        assert r.status == 200 and r.content_type == "application/octet-stream"
        meta = msgspec.json.decode(r.headers["metadata"])
        assert meta["model"] == "tiny" and meta["id"].startswith("embd-")
        assert meta["usage"] == {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0}
        assert meta["data"] == [
            {"index": 0, "embed_dtype": "float16", "endianness": "big", "start": 0, "end": 6,
             "shape": [3]},
            {"index": 1, "embed_dtype": "float16", "endianness": "big", "start": 6, "end": 12,
             "shape": [3]}]
        body = await r.read()
        assert np.frombuffer(body, ">f2").tolist() == [3.0, 4.0, 0.0, 3.0, 4.0, 12.0]
        only = await client.post("/v1/embeddings", json={
            "input": "c", "normalize": False, "encoding_format": "bytes_only",
            "embed_dtype": "bfloat16"})
        assert "metadata" not in only.headers
        bits = np.frombuffer(await only.read(), "<u2").astype(np.uint32) << 16
        assert bits.view(np.float32).tolist() == [3.0, 4.0, 12.0]
        raw = await post(client, "/pooling", {"input": "c", "task": "token_embed",
                                              "normalize": False, "encoding_format": "base64",
                                              "embed_dtype": "float16"})
        data = np.frombuffer(base64.b64decode(raw["data"][0]["data"]), "<f2")
        assert data.reshape(2, 3).tolist() == [[3.0, 4.0, 12.0]] * 2
        rows = await client.post("/pooling", json={"input": "c", "task": "token_embed",
                                                   "encoding_format": "bytes",
                                                   "normalize": False})
        assert msgspec.json.decode(rows.headers["metadata"])["data"][0]["shape"] == [2, 3]
        assert len(await rows.read()) == 2 * 3 * 4
        sent = len(gateway.tokenizers.sent)
        for body, param, message in (
                ({"embed_dtype": "int8"}, "embed_dtype", "embed_dtype must be one of float32,"),
                ({"endianness": "middle"}, "endianness", "endianness must be one of native,")):
            error = (await post(client, "/v1/embeddings", {"input": "a", **body}, 400))["error"]
            assert message in error["message"] and error["param"] == param
        assert len(gateway.tokenizers.sent) == sent             # refused before anything ran
    serve(EMBED, check)


def test_a_token_classifier_answers_every_tokens_logits_on_pooling_only():
    async def check(client, gateway):
        raw = await post(client, "/pooling", {"input": ["c", "b"]})
        assert gateway.tokenizers.sent[-1].pooling.per_token       # its own task: per token
        assert raw["data"][0]["data"] == [[3.0, 4.0, 12.0]] * 2       # two tokens' logits
        assert raw["data"][1]["data"] == [[0.0, 0.0, 2.0]] * 2
        probs = await post(client, "/pooling", {"input": "a", "task": "token_classify",
                                                "use_activation": True})
        softmax = np.exp([3.0, 4.0, 0.0]) / np.exp([3.0, 4.0, 0.0]).sum()
        assert probs["data"][0]["data"] == [pytest.approx(softmax.tolist())] * 2
        r = await client.post("/pooling", json={"input": "a", "encoding_format": "bytes"})
        assert msgspec.json.decode(r.headers["metadata"])["data"][0]["shape"] == [2, 3]
        assert np.frombuffer(await r.read(), "<f4").tolist() == [3.0, 4.0, 0.0] * 2
        sent = len(gateway.tokenizers.sent)
        error = (await post(client, "/pooling", {"input": "a", "task": "token_embed"},
                            400))["error"]
        assert "it serves token_classify" in error["message"] and error["param"] == "task"
        for path, body, message in (
                ("/v1/embeddings", {"input": "a"}, "this model's is token_classify"),
                ("/classify", {"input": "a"}, "this model's is token_classify"),
                ("/score", {"text_1": "a", "text_2": "b"}, "scores need an embedding model"),
                ("/rerank", {"query": "a", "documents": ["b"]}, "scores need an embedding")):
            error = (await post(client, path, body, 400))["error"]
            assert message in error["message"], (path, error)
        assert len(gateway.tokenizers.sent) == sent             # refused before anything ran
    serve(TAGGER, check)


def test_embedding_refusals_are_openai_errors():
    async def check(client, gateway):
        for body, message in (
                ({"input": "a", "dimensions": 1}, "dimensions=1 is not one of"),
                ({"input": []}, "input must not be an empty list"),
                ({"input": ["a"] * 10_000}, "at most 2048 entries, got 10000"),
                ({"input": "a", "encoding_format": "hex"}, "encoding_format must be one of"),
                ({"input": 5}, "invalid request")):
            error = (await post(client, "/v1/embeddings", body, 400))["error"]
            assert message in error["message"] and error["type"] == "BadRequestError"
        assert gateway.tokenizers.sent == []           # refused before anything ran
        error = (await post(client, "/classify", {"input": "a"}, 400))["error"]
        assert "task is classify, but this model's is embed" in error["message"]
        error = (await post(client, "/v1/completions", {"prompt": "a"}, 400))["error"]
        assert "--runner pooling" in error["message"] and error["param"] == "model"
        error = (await post(client, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "a"}]}, 400))["error"]
        assert "--runner pooling" in error["message"]
        for path, body in (("/v1/responses", {"input": "a", "background": True}),
                           ("/v1/messages", {"model": "tiny", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "a"}]}),
                           ("/api/generate", {"model": "tiny", "prompt": "a"}),
                           ("/api/chat", {"model": "tiny",
                                          "messages": [{"role": "user", "content": "a"}]})):
            r = await client.post(path, json=body)
            assert r.status == 400 and "--runner pooling" in await r.text(), path
        assert gateway.tokenizers.sent == []
    serve(EMBED, check)


def test_a_generating_model_refuses_pooling_naming_the_runner():
    async def check(client, gateway):
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/pooling", {"input": "a"}),
                           ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/v1/rerank", {"query": "a", "documents": ["b"]}),
                           ("/classify", {"input": "a"})):
            error = (await post(client, path, body, 400))["error"]
            assert "--runner generate; start it with --runner pooling" in error["message"]
    serve(None, check)


def test_a_refused_input_fails_the_request_and_aborts_the_rest():
    async def check(client, gateway):
        error = (await post(client, "/v1/embeddings", {"input": ["slow 1", "refuse", "slow 2"]},
                            400))["error"]
        assert error["message"] == "too long" and error["param"] == "input"
        (abort,) = gateway.scheduler.sent
        rid = gateway.tokenizers.sent[0].req_id.rsplit("-", 1)[0]
        assert abort.seq_ids == [SeqId(f"{rid}-0", 0), SeqId(f"{rid}-2", 0)]
        assert gateway.routes == {} and gateway.in_flight == 0
    serve(EMBED, check)


def test_a_client_gone_aborts_the_inputs_still_running():
    async def check(client, gateway):
        with pytest.raises(asyncio.TimeoutError):
            await client.post("/v1/embeddings", json={"input": ["a", "slow"]},
                              timeout=aiohttp.ClientTimeout(total=0.3))
        for _ in range(200):
            if gateway.scheduler.sent:
                break
            await asyncio.sleep(0.01)
        rid = gateway.tokenizers.sent[0].req_id.rsplit("-", 1)[0]
        (abort,) = gateway.scheduler.sent                  # "a" had finished
        assert abort.seq_ids == [SeqId(f"{rid}-1", 0)]
        assert gateway.routes == {} and gateway.in_flight == 0
    serve(EMBED, check)


def test_score_and_rerank_with_an_embedding_model_use_cosine():
    async def check(client, gateway):
        s = await post(client, "/v1/score", {"text_1": "a", "text_2": ["a", "b", "c"]})
        assert [d["score"] for d in s["data"]] == pytest.approx([1.0, 0.0, 25 / 65])
        assert s["data"][0]["object"] == "score" and s["usage"]["prompt_tokens"] == 8
        nn = await post(client, "/score", {"text_1": ["a", "b"], "text_2": ["c", "b"]})
        assert [d["score"] for d in nn["data"]] == pytest.approx([25 / 65, 1.0])
        r = await post(client, "/rerank", {"query": "a", "documents": ["b", "c", "a"],
                                           "top_n": 2})
        assert [(x["index"], x["document"]["text"]) for x in r["results"]] == [(2, "a"),
                                                                               (1, "c")]
        assert r["results"][0]["relevance_score"] == pytest.approx(1.0)
        assert r["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
        error = (await post(client, "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]},
                            400))["error"]
        assert "1:1, 1:N or N:N" in error["message"]
    serve(EMBED, check)


def test_a_cross_encoder_scores_each_pair_as_one_input():
    async def check(client, gateway):
        r = await post(client, "/v2/rerank", {"query": "qq", "documents": ["qq", "q", "qqqq"],
                                              "return_documents": False})
        sigmoid = lambda x: 1 / (1 + np.exp(-x))              # noqa: E731
        assert r["results"] == [
            {"index": 1, "relevance_score": pytest.approx(sigmoid(1.0))},
            {"index": 0, "relevance_score": 0.5},
            {"index": 2, "relevance_score": pytest.approx(sigmoid(-2.0))}]
        assert r["meta"]["billed_units"] == {"search_units": 1}
        pairs = [(s.prompt, s.pooling.pair) for s in gateway.tokenizers.sent]
        assert pairs == [("qq", "qq"), ("qq", "q"), ("qq", "qqqq")]
        raw = await post(client, "/score", {"text_1": "qq", "text_2": "q",
                                            "use_activation": False})
        assert raw["data"][0]["score"] == 1.0
        error = (await post(client, "/v1/embeddings", {"input": "a"}, 400))["error"]
        assert "task is embed, but this model's is classify" in error["message"]
    serve(RERANKER, check)


def test_classify_and_pooling_answer_vllms_shapes():
    async def check(client, gateway):
        c = await post(client, "/classify", {"input": ["a", "b"]})
        assert c["id"].startswith("classify-") and c["object"] == "list"
        first = c["data"][0]      # logits [3, 4, 0] read as a 2-label model's: softmax of all
        assert first["label"] == "pos" and first["num_classes"] == 3
        assert first["probs"] == pytest.approx(
            (np.exp([3.0, 4.0, 0.0]) / np.exp([3.0, 4.0, 0.0]).sum()).tolist(), rel=1e-6)
        raw = await post(client, "/pooling", {"input": "a"})
        assert raw["data"] == [{"index": 0, "object": "pooling", "data": [3.0, 4.0, 0.0]}]
        assert raw["id"].startswith("pool-")
    serve(SENTIMENT, check)


def test_ollamas_embed_routes():
    async def check(client, gateway):
        r = await post(client, "/api/embed", {"model": "tiny:latest", "input": ["a", "c"]})
        assert r["model"] == "tiny:latest" and r["prompt_eval_count"] == 4
        assert r["embeddings"][0] == pytest.approx([0.6, 0.8, 0.0])
        assert gateway.tokenizers.sent[0].pooling.truncate_prompt_tokens == -1
        cut = await post(client, "/api/embed", {"model": "tiny", "input": "c", "dimensions": 2,
                                                "truncate": False})
        assert cut["embeddings"] == [pytest.approx([0.6, 0.8])]
        assert gateway.tokenizers.sent[-1].pooling.truncate_prompt_tokens is None
        assert (await post(client, "/api/embed", {"model": "tiny"}))["embeddings"] == []
        old = await post(client, "/api/embeddings", {"model": "tiny", "prompt": "a"})
        assert old == {"embedding": pytest.approx([0.6, 0.8, 0.0])}
        error = await post(client, "/api/embed", {"model": "other", "input": "a"}, 404)
        assert set(error) == {"error"}                       # Ollama's error shape
        error = await post(client, "/api/embed", {"model": "tiny", "input": "a",
                                                  "dimensions": 1}, 400)
        assert "dimensions=1 is not one of" in error["error"]
    serve(EMBED, check)


def test_pooling_token_embed_answers_every_tokens_rows_and_refuses_other_tasks(monkeypatch):
    from pagewire.gateway import pooling_api
    # 64 tokens x 3 floats x 4 bytes an input at most: room for two inputs, not three
    monkeypatch.setattr(pooling_api, "MAX_TOKEN_ROWS_BYTES", 2 * 64 * 3 * 4)

    async def check(client, gateway):
        rows = await post(client, "/pooling", {"input": ["a", "c"], "task": "token_embed"})
        assert gateway.tokenizers.sent[-1].pooling.per_token
        assert [d["object"] for d in rows["data"]] == ["pooling", "pooling"]
        assert rows["data"][0]["data"] == [pytest.approx([0.6, 0.8, 0.0])] * 2   # normalised
        assert rows["data"][1]["data"] == [pytest.approx([3 / 13, 4 / 13, 12 / 13])] * 2
        assert rows["usage"]["prompt_tokens"] == 4
        raw = await post(client, "/pooling", {"input": "c", "task": "token_embed",
                                              "normalize": False, "encoding_format": "base64"})
        data = np.frombuffer(base64.b64decode(raw["data"][0]["data"]), "<f4")
        assert data.reshape(2, 3).tolist() == [[3.0, 4.0, 12.0]] * 2
        one = await post(client, "/pooling", {"input": "c", "task": "embed"})
        assert one["data"][0]["data"] == [3.0, 4.0, 12.0]
        assert not gateway.tokenizers.sent[-1].pooling.per_token
        sent = len(gateway.tokenizers.sent)
        for task in ("token_classify", "classify", "reward"):
            error = (await post(client, "/pooling", {"input": "a", "task": task}, 400))["error"]
            assert f"task {task!r} is not supported by this model" in error["message"]
            assert "it serves embed, token_embed" in error["message"]
            assert (error["param"], error["type"]) == ("task", "BadRequestError")
        error = (await post(client, "/pooling", {"input": ["a", "b", "c"],
                                                 "task": "token_embed"}, 400))["error"]
        assert "task token_embed answers up to 64 x 3 floats an input: at most 2 inputs a " \
            "request, got 3" in error["message"] and error["param"] == "input"
        assert len(gateway.tokenizers.sent) == sent             # refused before anything ran
    serve(EMBED, check)


def test_a_classifier_refuses_token_embed():
    async def check(client, gateway):
        error = (await post(client, "/pooling", {"input": "a", "task": "token_embed"},
                            400))["error"]
        assert "task 'token_embed' is not supported" in error["message"]
        assert "it serves classify" in error["message"] and gateway.tokenizers.sent == []
    serve(SENTIMENT, check)
