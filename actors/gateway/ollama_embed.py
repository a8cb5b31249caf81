"""Ollama's embedding routes on the pooling path (pooling_routes.py): /api/embed (a text or a
list of texts -> {"embeddings": [...]}) and the older /api/embeddings (one `prompt` ->
{"embedding": [...]}), for Ollama's clients (Open WebUI's retrieval). Errors are Ollama's
{"error": "..."} (ollama_routes.py registers the shape for /api/)."""
from __future__ import annotations

import time

import msgspec
from aiohttp import web

from ..pooler_info import EMBED
from ..pooling_outputs import check_dimensions, embedding
from .ollama import model_name
from .pooling_api import json_answer, pooling_inputs
from .protocol import decode_body


class EmbedRequest(msgspec.Struct, kw_only=True):
    """/api/embed. `truncate` (Ollama's default true): an input over the context is cut to it,
    else refused."""
    model: str
    input: str | list[str] | None = None
    truncate: bool | None = None                     # None: true
    dimensions: int | None = None
    keep_alive: str | int | float | None = None      # accepted, unused: always loaded
    options: dict | None = None                      # accepted, unused here


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """/api/embeddings (Ollama's older route): one prompt."""
    model: str
    prompt: str = ""
    keep_alive: str | int | float | None = None
    options: dict | None = None


class _Fields(msgspec.Struct, kw_only=True):
    """What pooling_routes' run() reads of a body."""
    model: str | None
    truncate_prompt_tokens: int | None
    priority: int = 0
    cache_salt: str | None = None


class OllamaEmbedRoutes:
    def __init__(self, pooling):
        self.pooling = pooling                     # pooling_routes.PoolingRoutes

    def routes(self) -> list:
        return [web.post("/api/embed", self.embed), web.post("/api/embeddings", self.embeddings)]

    async def embed(self, request: web.Request) -> web.Response:
        req = decode_body(await request.read(), EmbedRequest)
        fields = _Fields(model=model_name(req.model),
                         truncate_prompt_tokens=None if req.truncate is False else -1)
        pooler = self.pooling.pooler(fields, EMBED, "/api/embed")
        check_dimensions(pooler, req.dimensions)
        start = time.monotonic()
        texts = pooling_inputs(req.input) if req.input else []     # none: Ollama's "load"
        out = await self.pooling.run(request, fields, "embed", texts) if texts else None
        vectors = [embedding(pooler, v, req.dimensions).tolist() for v in out.vectors] \
            if out else []
        return json_answer({
            "model": req.model, "embeddings": vectors,
            "total_duration": int((time.monotonic() - start) * 1e9), "load_duration": 0,
            "prompt_eval_count": out.prompt_tokens if out else 0})

    async def embeddings(self, request: web.Request) -> web.Response:
        req = decode_body(await request.read(), EmbeddingsRequest)
        fields = _Fields(model=model_name(req.model), truncate_prompt_tokens=-1)
        pooler = self.pooling.pooler(fields, EMBED, "/api/embeddings")
        if not req.prompt:                         # Ollama answers an empty prompt so
            return json_answer({"embedding": []})
        out = await self.pooling.run(request, fields, "embed", [{"prompt": req.prompt}])
        return json_answer({"embedding": embedding(pooler, out.vectors[0]).tolist()})
