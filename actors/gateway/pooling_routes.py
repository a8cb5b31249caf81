"""/v1/embeddings, /pooling, /score, /rerank and /classify: each input becomes one engine
request (a TokenizeRequest with a PoolingInput, wire/pooling.py), all sent at once and
gathered; the engine answers each with the model's raw pooled vector, and everything a request
asks of it (dimensions, normalisation, activation, scores, encoding) is done here
(pooling_outputs.py). A refusal or failure of any input fails the whole response; whatever way
the handler ends, inputs not yet finished are aborted at the scheduler."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from pagewire.wire.ids import SeqId
from pagewire.wire.pooling import PoolingInput, from_bytes
from pagewire.wire.sampling_params import SamplingParams
from pagewire.wire.to_gateway import RequestFailed
from pagewire.wire.to_scheduler import Abort
from pagewire.wire.to_tokenizer import TokenizeRequest

from ..pooler_info import CLASSIFY, EMBED, PoolerInfo
from ..pooling_outputs import (BYTES_FORMATS, check_dimensions, check_encoding,
                               check_pooling_task, check_scores, check_task, cosine,
                               cross_score, embedding, encoded, per_token_rows, probabilities)
from .ollama_embed import OllamaEmbedRoutes
from .pooling_api import (ClassifyBody, EmbeddingBody, RerankBody, ScoreBody, binary_answer,
                          check_token_inputs, classify_data, embedding_data, json_answer, listed,
                          pooling_inputs, rerank_answer, rerank_texts, score_data, score_texts)
from .protocol import ApiError, chat_images, chat_messages, decode_body

# A pooled prompt samples nothing; the engine still takes a SamplingParams (wire contract).
POOL_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class Pooled:
    """The engine's answers to one HTTP request's inputs, in input order."""
    vectors: list[np.ndarray]
    prompt_tokens: int
    counts: list[int]                    # each input's prompt tokens


class PoolingRoutes:
    def __init__(self, gateway):
        self.gw = gateway

    def routes(self) -> list:
        return [web.post("/v1/embeddings", self.embeddings), web.post("/pooling", self.pooling),
                web.post("/score", self.score), web.post("/v1/score", self.score),
                web.post("/rerank", self.rerank), web.post("/v1/rerank", self.rerank),
                web.post("/v2/rerank", self.rerank), web.post("/classify", self.classify),
                web.post("/v1/classify", self.classify), *OllamaEmbedRoutes(self).routes()]

    def pooler(self, body, task: str | None, what: str) -> PoolerInfo:
        """The served model's pooler where it serves `what` (else a 400 naming the runner)."""
        self.gw.check_model(body.model)
        return check_task(self.gw.config.model.model_info.pooler, task, what)

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self.vectors(request, "embedding")

    async def pooling(self, request: web.Request) -> web.Response:
        return await self.vectors(request, "pooling")

    async def vectors(self, request: web.Request, kind: str) -> web.Response:
        """/v1/embeddings (an embedding model's vectors, normalised as the model says unless
        asked otherwise) or /pooling (the model's raw output, embedding or logits: normalised
        or cut only where asked)."""
        body = decode_body(await request.read(), EmbeddingBody)
        path = "/v1/embeddings" if kind == "embedding" else "/pooling"
        pooler = self.pooler(body, EMBED if kind == "embedding" else None, path)
        per_token = kind == "pooling" and check_pooling_task(pooler, body.task, path)
        if body.dimensions is not None or kind == "embedding":
            check_dimensions(pooler, body.dimensions)
        check_encoding(body.encoding_format, body.embed_dtype, body.endianness)  # 400 first
        prompts = await self.chat_input(body) if body.messages is not None \
            else pooling_inputs(body.input)
        if per_token:
            check_token_inputs(len(prompts), self.gw.config.model.max_model_len, pooler.size)
        short = "embd" if kind == "embedding" else "pool"           # vLLM's id prefixes
        out = await self.run(request, body, short, prompts, per_token=per_token)
        vectors = [per_token_rows(pooler, v.reshape(n, -1), body.dimensions,
                                  body.wants_normalized(), bool(body.use_activation))
                   for v, n in zip(out.vectors, out.counts)] if per_token else \
            [_shaped(pooler, body, kind, v) for v in out.vectors]
        if body.encoding_format in BYTES_FORMATS:
            return binary_answer(self.answer_id(short), self.model_name(body), vectors,
                                 out.prompt_tokens, body)
        data = embedding_data([encoded(v, body.encoding_format, body.embed_dtype,
                                       body.endianness) for v in vectors], kind)
        return json_answer(listed(self.answer_id(short), self.model_name(body),
                                        data, out.prompt_tokens))

    async def classify(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), ClassifyBody)
        pooler = self.pooler(body, CLASSIFY, "/classify")
        out = await self.run(request, body, "classify", pooling_inputs(body.input))
        probs = [probabilities(pooler, v, body.activation_asked()).tolist() for v in out.vectors]
        return json_answer(listed(self.answer_id("classify"),
                                        self.model_name(body), classify_data(probs, pooler.labels),
                                        out.prompt_tokens))

    async def score(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), ScoreBody)
        pooler = self.pooler(body, None, "/score")
        first, second = score_texts(body.text_1, body.text_2)
        scores, tokens = await self.scores(request, body, pooler, first, second)
        return json_answer(listed(self.answer_id("score"), self.model_name(body),
                                        score_data(scores), tokens))

    async def rerank(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), RerankBody)
        pooler = self.pooler(body, None, request.path)
        query, documents = rerank_texts(body)
        scores, tokens = await self.scores(request, body, pooler, query, documents)
        return json_answer(rerank_answer(
            self.answer_id("rerank"), self.model_name(body), body, scores, tokens,
            cohere=request.path == "/v2/rerank"))

    async def scores(self, request: web.Request, body, pooler: PoolerInfo, first: list[str],
                     second: list[str]) -> tuple[list[float], int]:
        """Pair i's score ((first[0] or first[i], second[i])) and the prompt tokens spent: a
        cross-encoder (classify) reads each pair as one input; an embedding model embeds every
        text once and scores by cosine similarity."""
        queries = first * len(second) if len(first) == 1 else first
        check_scores(pooler)
        if pooler.task == CLASSIFY:
            out = await self.run(request, body, "score", [{"prompt": q} for q in queries],
                                 pairs=second)
            return [cross_score(pooler, v, body.activation_asked()) for v in out.vectors], \
                out.prompt_tokens
        out = await self.run(request, body, "score", [{"prompt": t} for t in first + second])
        left, right = out.vectors[:len(first)], out.vectors[len(first):]
        return [cosine(left[0 if len(first) == 1 else i], v) for i, v in enumerate(right)], \
            out.prompt_tokens

    async def chat_input(self, body: EmbeddingBody) -> list[dict]:
        """vLLM's chat embeddings: the messages as one input, their images fetched."""
        if body.input is not None:
            raise ApiError(400, "give input or messages, not both", "messages")
        return [{"messages": chat_messages(body),
                 "images": await self.gw.media.fetch_all(chat_images(body))}]

    def answer_id(self, kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex}"

    def model_name(self, body) -> str:
        return body.model or self.gw.model_name

    async def run(self, request: web.Request, body, kind: str, prompts: list[dict],
                  pairs: list[str] | None = None, per_token: bool = False) -> Pooled:
        """Pool every prompt (with its pair, for a cross-encoder) as one engine request each;
        the raw vectors in prompt order (`per_token`: each prompt's every token's rows, flat),
        or the first refusal or failure as an ApiError."""
        gw, rid = self.gw, f"{kind}-{uuid.uuid4().hex}"
        lora = gw.check_model(body.model)
        salt = gw.keys.salt(request, body)
        subs = [TokenizeRequest(req_id=f"{rid}-{i}", arrival_time=time.time(),
                                sampling=POOL_SAMPLING, prompt=p.get("prompt"),
                                prompt_token_ids=p.get("prompt_token_ids"),
                                messages=p.get("messages"), images=p.get("images", []),
                                add_generation_prompt=False, cache_salt=salt,
                                priority=body.priority, lora=lora, pooling=PoolingInput(
                                    pairs[i] if pairs else None, body.truncate_prompt_tokens,
                                    per_token))
                for i, p in enumerate(prompts)]
        seqs = {SeqId(s.req_id, 0): i for i, s in enumerate(subs)}
        queue: asyncio.Queue = asyncio.Queue()
        for key in [s.req_id for s in subs] + list(seqs):
            gw.routes[key] = queue
        open_ids = set(seqs)
        gw.in_flight += 1
        gw.metrics.on_request_start(list(seqs), api="pooling")
        try:
            for sub in subs:
                gw.tokenizers.send(sub)
            return await _gather(queue, seqs, open_ids)
        finally:
            gw.in_flight -= 1
            gw.metrics.on_request_end(list(seqs), open_ids)
            for key in [s.req_id for s in subs] + list(seqs):
                gw.routes.pop(key, None)
            if open_ids:
                gw.scheduler.send(Abort(sorted(open_ids)))


def _shaped(pooler: PoolerInfo, body: EmbeddingBody, kind: str, raw: np.ndarray) -> np.ndarray:
    """One vector as the endpoint answers it. /v1/embeddings: cut to `dimensions`, normalised
    as the model does unless the request says. /pooling: the model's raw output (an
    embedding, or a classifier's logits), cut, normalised or activated only where asked."""
    if kind == "pooling" and pooler.task == CLASSIFY:
        return probabilities(pooler, raw, bool(body.use_activation))
    normalize = body.wants_normalized()
    if kind == "pooling" and normalize is None:
        normalize = False
    return embedding(pooler, raw, body.dimensions, normalize)


async def _gather(queue: asyncio.Queue, seqs: dict[SeqId, int], open_ids: set) -> Pooled:
    """Each input's final delta (its pooled vector) until all have come; removes finished
    ids from `open_ids` (what is left there is aborted by the caller)."""
    vectors: list[np.ndarray | None] = [None] * len(seqs)
    counts = [0] * len(seqs)
    while open_ids:
        msg = await queue.get()
        if isinstance(msg, RequestFailed):      # refused by a tokenizer, or the engine restarted
            open_ids.discard(SeqId(msg.req_id, 0))
            raise ApiError(msg.status, msg.message, msg.param, msg.error_type)
        if msg.seq_id not in open_ids or not msg.finish_reason:
            continue
        open_ids.discard(msg.seq_id)
        if msg.finish_reason == "rejected":
            raise ApiError(503, msg.error or "the server is overloaded")
        if msg.finish_reason != "stop" or msg.pooled is None:
            raise ApiError(500, msg.error or f"pooling failed ({msg.finish_reason})")
        vectors[seqs[msg.seq_id]] = from_bytes(msg.pooled)
        counts[seqs[msg.seq_id]] = msg.num_prompt_tokens
    return Pooled(vectors, sum(counts), counts)
