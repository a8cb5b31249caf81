"""The pooling endpoints' requests and answers, in vLLM's shapes (OpenAI's embeddings, vLLM's
/pooling, /score and /classify, Jina's and Cohere's rerank): bodies as typed structs, their
inputs validated into what each engine request pools, and the response dicts. No I/O here
(pooling_routes.py runs the requests; pooling_outputs.py post-processes the vectors)."""
from __future__ import annotations

import time

import msgspec
import numpy as np
from aiohttp import web

from ..vector_encoding import vector_bytes
from .protocol import ApiError, ChatMessageBody

# One request's inputs (texts, token-id lists, score pairs, rerank documents): each is an
# engine request of its own, tokenized and pooled, so a client may not ask for unbounded
# numbers in one body. OpenAI caps /v1/embeddings at 2048 inputs; vLLM caps nothing. A batch
# of more is split by the client (docs/pooling.md).
MAX_POOLING_INPUTS = 2048
# token_embed answers every token's hidden state: an input may be max_model_len x hidden floats.
# A request may ask for at most this many bytes of float32 rows at its inputs' longest (one
# input is always allowed), so one body cannot make the gateway hold and encode gigabytes.
MAX_TOKEN_ROWS_BYTES = 1 << 30

Input = str | list[str | int | list[int]]


class _PoolingCommon(msgspec.Struct, kw_only=True):
    """Fields every pooling body takes. Unknown fields are ignored (clients send extras)."""
    model: str | None = None
    user: str | None = None                  # accepted, unused (OpenAI's)
    truncate_prompt_tokens: int | None = None  # -1: the model's context (wire/pooling.py)
    priority: int = 0
    cache_salt: str | None = None


class EmbeddingBody(_PoolingCommon, kw_only=True):
    """/v1/embeddings and /pooling. `normalize` (older vLLM) or `use_activation` (newer)
    override the model's normalisation; None keeps it. `input`, or vLLM's chat embeddings:
    `messages`, one input (rendered by the model's chat template, or its texts joined; an
    image part alone: CLIP's image embedding). `task` (/pooling only, vLLM's): None or the
    model's own task (one vector an input), or token_embed (every token's hidden state)."""
    task: str | None = None
    input: Input | None = None
    messages: list[ChatMessageBody] | None = None
    encoding_format: str = "float"
    embed_dtype: str = "float32"             # base64 and bytes: vector_encoding.EMBED_DTYPES
    endianness: str = "native"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def wants_normalized(self) -> bool | None:
        return self.normalize if self.normalize is not None else self.use_activation


class _Activated(_PoolingCommon, kw_only=True):
    """A classifier's activation switch under vLLM's three names (newest first)."""
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def activation_asked(self) -> bool | None:
        return next((v for v in (self.use_activation, self.activation, self.softmax)
                     if v is not None), None)


class ClassifyBody(_Activated, kw_only=True):
    input: Input


class ScoreBody(_Activated, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]


class DocumentBody(msgspec.Struct, kw_only=True):
    text: str


class RerankBody(_Activated, kw_only=True):
    """Jina's and Cohere's rerank. top_n None or 0: every document (vLLM's 0)."""
    query: str
    documents: list[str | DocumentBody]
    top_n: int | None = None
    return_documents: bool = True


def pooling_inputs(value: Input, name: str = "input") -> list[dict]:
    """An input field as engine prompts: [{"prompt": text} | {"prompt_token_ids": ids}]. A
    list of ints is one tokenized input; else each element is a text or a token-id list.
    Empty strings pass (they encode to the special tokens; a tokenizer that adds none
    refuses them, as any input that encodes to nothing)."""
    if isinstance(value, str):
        return [{"prompt": value}]
    if not value:
        raise ApiError(400, f"{name} must not be an empty list", name)
    if all(isinstance(x, int) for x in value):
        return [{"prompt_token_ids": list(value)}]
    if any(isinstance(x, int) for x in value):
        raise ApiError(400, f"{name} must be a string, a list of strings, a list of token ids "
                       "or a list of token-id lists", name)
    check_inputs(len(value), name)
    return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": x} for x in value]


def check_inputs(count: int, name: str) -> None:
    if count > MAX_POOLING_INPUTS:
        raise ApiError(400, f"{name} may hold at most {MAX_POOLING_INPUTS} entries, got "
                       f"{count}; split it over several requests", name)


def check_token_inputs(count: int, max_len: int, width: int) -> None:
    """A token_embed request's inputs fit MAX_TOKEN_ROWS_BYTES at their longest."""
    per_input = max_len * width * 4
    most = max(1, MAX_TOKEN_ROWS_BYTES // per_input)
    if count > most:
        raise ApiError(400, f"task token_embed answers up to {max_len} x {width} floats an "
                       f"input: at most {most} inputs a request, got {count}; split them over "
                       "several requests", "input")


def score_texts(text_1: str | list[str], text_2: str | list[str],
                names: tuple[str, str] = ("text_1", "text_2")) -> tuple[list[str], list[str]]:
    """(queries, documents) as lists: one query against N documents, or N against N (pair i
    is (queries[i], documents[i])); vLLM's rule: 1:1, 1:N or N:N."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in zip(names, (first, second)):
        if not texts:
            raise ApiError(400, f"{name} must not be an empty list", name)
        check_inputs(len(texts), name)
    if len(first) > 1 and len(first) != len(second):
        raise ApiError(400, f"{names[0]} and {names[1]} must be 1:1, 1:N or N:N; got "
                       f"{len(first)}:{len(second)}", names[0])
    return first, second


def documents_text(documents: list[str | DocumentBody]) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in documents]


def rerank_texts(body: RerankBody) -> tuple[list[str], list[str]]:
    """(the query, the documents) of a rerank, checked before anything runs."""
    if body.top_n is not None and body.top_n < 0:
        raise ApiError(400, f"top_n must be positive (0: every document), got {body.top_n}",
                       "top_n")
    return score_texts(body.query, documents_text(body.documents), ("query", "documents"))


def usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0}


def listed(req_id: str, model: str, data: list[dict], prompt_tokens: int) -> dict:
    """The list answer /v1/embeddings, /pooling, /score and /classify share."""
    return {"id": req_id, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": usage(prompt_tokens)}


def embedding_data(vectors: list, kind: str = "embedding") -> list[dict]:
    """/v1/embeddings' data ({object: "embedding", embedding}) or /pooling's ({object:
    "pooling", data})."""
    key = "embedding" if kind == "embedding" else "data"
    return [{"index": i, "object": kind, key: v} for i, v in enumerate(vectors)]


def score_data(scores: list[float]) -> list[dict]:
    return [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]


def classify_data(probs: list[list[float]], labels: list[str]) -> list[dict]:
    """Each input's probabilities and its most likely label (LABEL_i where unnamed)."""
    out = []
    for i, p in enumerate(probs):
        best = max(range(len(p)), key=p.__getitem__)
        label = labels[best] if best < len(labels) else f"LABEL_{best}"
        out.append({"index": i, "label": label, "probs": p, "num_classes": len(p)})
    return out


def rerank_answer(req_id: str, model: str, body: RerankBody, scores: list[float],
                  prompt_tokens: int, cohere: bool = False) -> dict:
    """Jina's answer (vLLM's /rerank and /v1/rerank): results sorted by score, highest first
    (ties keep document order), cut to top_n; /v2/rerank adds Cohere's `meta` (billed: one
    search unit a request)."""
    texts = documents_text(body.documents)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[:body.top_n]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    answer = {"id": req_id, "model": model, "usage": {"prompt_tokens": prompt_tokens,
                                                      "total_tokens": prompt_tokens},
              "results": results}
    if cohere:
        answer["meta"] = {"api_version": {"version": "2"},
                          "billed_units": {"search_units": 1}}
    return answer


def binary_answer(req_id: str, model: str, vectors: list, prompt_tokens: int,
                  body: EmbeddingBody) -> web.Response:
    """vLLM's binary answer (encoding_format bytes or bytes_only): every input's values in
    embed_dtype and endianness, back to back in input order; with "bytes", a `metadata`
    header (JSON) gives each one's index, byte range [start, end) and shape, and the usage."""
    chunks, items, offset = [], [], 0
    for i, v in enumerate(vectors):
        chunks.append(vector_bytes(v, body.embed_dtype, body.endianness))
        items.append({"index": i, "embed_dtype": body.embed_dtype, "endianness": body.endianness,
                      "start": offset, "end": offset + len(chunks[-1]),
                      "shape": list(np.shape(v))})
        offset += len(chunks[-1])
    headers = {} if body.encoding_format == "bytes_only" else {
        "metadata": msgspec.json.encode({"id": req_id, "created": int(time.time()),
                                         "model": model, "data": items,
                                         "usage": usage(prompt_tokens)}).decode()}
    return web.Response(body=b"".join(chunks), headers=headers,
                        content_type="application/octet-stream")


def json_answer(obj: dict) -> web.Response:
    """An answer as msgspec's JSON: 2,048 vectors of 768 floats encode in 0.07 s (the json
    module's 0.77 s), on the gateway's event loop."""
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")
