"""Ollama's routes: /api/chat and /api/generate (translated by ollama.py into the gateway's
chat and completions requests, answered through ollama_door.py), /api/tags, /api/ps,
/api/show and /api/version about the served model, and GET / which clients probe. Errors on
/api/ are Ollama's {"error": "..."}; the routes sit behind the same API keys as /v1/."""
from __future__ import annotations

import asyncio
import os
from datetime import datetime, timezone

import msgspec
from aiohttp import web

import pagewire

from ..gguf_header import GGML_TYPES, read_gguf_header
from ..model_files import safetensors_files, safetensors_header
from ..model_info import GGUF_ARCHITECTURES
from .ollama import ChatRequest, GenerateRequest, chat_body, generate_body, model_name
from .ollama_door import OllamaChat, OllamaGenerate, now_iso
from .protocol import ChatBody, decode_body

# What /api/version reports: the Ollama release whose API these routes follow (clients gate
# features such as streamed tool calls on it); pagewire's own version is reported beside it.
OLLAMA_API_VERSION = "0.12.0"
NEVER = "2318-01-01T00:00:00Z"       # /api/ps expires_at: the model is never unloaded


class ShowBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None          # older clients' spelling
    verbose: bool = False


class OllamaRoutes:
    def __init__(self, gateway):
        self.gateway, self.config = gateway, gateway.config
        gateway.error_shapes.append(("/api/", OllamaChat.error_body))
        self._files: dict | None = None     # what the weights' files say, read once

    def routes(self) -> list:
        return [web.get("/", self.root), web.post("/api/chat", self.chat),
                web.post("/api/generate", self.generate), web.get("/api/tags", self.tags),
                web.get("/api/ps", self.ps), web.post("/api/show", self.show),
                web.get("/api/version", self.version)]

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = decode_body(await request.read(), ChatRequest)
        if not req.messages:             # Ollama's way to load a model: nothing to run
            return self._loaded(req, {"message": {"role": "assistant", "content": ""}})
        body = chat_body(req, self.config.model.max_model_len, self.config.server.reasoning_parser)
        return await self.gateway.serve_chat(request, body, door=OllamaChat)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = decode_body(await request.read(), GenerateRequest)
        if not req.prompt:
            return self._loaded(req, {"response": ""})
        body = generate_body(req, self.config.model.max_model_len,
                             self.config.server.reasoning_parser)
        if isinstance(body, ChatBody):
            return await self.gateway.serve_chat(request, body, door=OllamaGenerate)
        return await self.gateway.serve_completion(request, body, door=OllamaGenerate,
                                                   default_max_tokens=None)

    def _loaded(self, req, part: dict) -> web.Response:
        """Ollama's answer to a request with nothing to generate: the model is (un)loaded.
        Here it is always loaded; keep_alive 0 is answered as Ollama answers an unload."""
        self.gateway.check_model(model_name(req.model))
        reason = "unload" if req.keep_alive in (0, "0", "0s") else "load"
        return web.json_response({"model": req.model, "created_at": now_iso(), **part,
                                  "done": True, "done_reason": reason})

    async def tags(self, request: web.Request) -> web.Response:
        files = await self.files()
        return web.json_response({"models": [self._entry(name, parent, files)
                                             for name, parent in self._names()]})

    async def ps(self, request: web.Request) -> web.Response:
        files = await self.files()
        return web.json_response({"models": [
            dict(self._entry(name, parent, files), expires_at=NEVER,
                 context_length=self.config.model.max_model_len)
            for name, parent in self._names()]})

    async def show(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), ShowBody)
        asked = model_name(body.model or body.name or "")
        lora = self.gateway.loras.lookup(asked)      # a 404 for a model not served
        files = await self.files()
        info = self.config.model.model_info
        family = files["family"]
        server = self.config.server
        capabilities = ["completion"] + (["tools"] if server.enable_auto_tool_choice else []) + \
            (["thinking"] if server.reasoning_parser else [])
        if info.pooler is not None:       # Ollama's "embedding" (ollama_embed.py serves it)
            generates = info.pooler.also_generates
            capabilities = (capabilities if generates else []) + ["embedding"]
        return web.json_response({
            "license": "", "modelfile": f"# served by pagewire\nFROM {info.path}\n",
            "parameters": "", "template": files["template"],
            "details": self._details(files, self.gateway.model_name if lora else ""),
            "model_info": {"general.architecture": family,
                           "general.parameter_count": files["parameters"],
                           f"{family}.context_length": self.config.model.max_model_len,
                           f"{family}.embedding_length": info.hidden_size,
                           f"{family}.block_count": info.num_layers,
                           f"{family}.attention.head_count": info.num_heads,
                           f"{family}.attention.head_count_kv": info.num_kv_heads},
            "capabilities": capabilities, "modified_at": files["modified_at"]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_API_VERSION,
                                  "pagewire": pagewire.__version__})

    def _names(self) -> list[tuple[str, str]]:
        """(name, parent model) of the base model and each LoRA adapter."""
        return [(self.gateway.model_name, "")] + [
            (entry["id"], self.gateway.model_name)
            for entry in self.gateway.loras.model_entries(self.gateway.created)]

    def _entry(self, name: str, parent: str, files: dict) -> dict:
        return {"name": name, "model": name, "modified_at": files["modified_at"],
                "size": files["size"], "digest": self.config.model.model_info.digest,
                "details": self._details(files, parent)}

    def _details(self, files: dict, parent: str) -> dict:
        return {"parent_model": parent, "format": self.config.model.model_info.format,
                "family": files["family"], "families": [files["family"]],
                "parameter_size": _human(files["parameters"]),
                "quantization_level": files["quantization"]}

    async def files(self) -> dict:
        if self._files is None:         # header reads only, once; off the event loop
            self._files = await asyncio.to_thread(model_files, self.config)
        return self._files


def model_files(config) -> dict:
    """What the model's files tell Ollama's clients: family, parameter count, the weights'
    dominant format (GGUF type, safetensors dtype, or the quantization applied at load),
    size, modification time and the chat template."""
    info = config.model.model_info
    if info.format == "gguf":
        header = read_gguf_header(info.path)
        family = header.metadata.get("general.architecture", "")
        shapes = [(t.shape, GGML_TYPES.get(t.ggml_type, (str(t.ggml_type),))[0])
                  for t in header.tensors.values()]
        template = header.metadata.get("tokenizer.chat_template", "")
        files = [info.path]
    else:
        family = {hf: g for g, hf in GGUF_ARCHITECTURES.items()}.get(
            info.architecture, info.architecture.removesuffix("ForCausalLM").lower())
        files = safetensors_files(info.path)
        shapes = [(meta["shape"], meta["dtype"]) for f in files
                  for name, meta in safetensors_header(f).items() if name != "__metadata__"]
        template = _hf_template(info.path)
    counts: dict[str, int] = {}
    for shape, kind in shapes:
        counts[kind] = counts.get(kind, 0) + _numel(shape)
    quantization = info.stored_quantization or (
        config.model.quantization if config.model.quantization != "none" else
        max(counts, key=counts.get, default=""))
    if config.server.chat_template is not None:
        with open(config.server.chat_template) as f:
            template = f.read()
    mtime = max(os.path.getmtime(f) for f in files)
    return {"family": family, "parameters": sum(counts.values()),
            "quantization": quantization.upper(), "template": template,
            "size": sum(os.path.getsize(f) for f in files),
            "modified_at": datetime.fromtimestamp(mtime, timezone.utc).isoformat()}


def _hf_template(path: str) -> str:
    """The chat template of a Hugging Face directory (chat_template.jinja, or the
    tokenizer config's; a list of named templates gives its default)."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            template = msgspec.json.decode(f.read()).get("chat_template") or ""
    except (OSError, msgspec.DecodeError):
        return ""
    if isinstance(template, list):
        template = next((t.get("template", "") for t in template
                         if t.get("name") == "default"), "")
    return template if isinstance(template, str) else ""


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _human(n: int) -> str:
    """A parameter count as Ollama writes it: 135M, 7.6B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
