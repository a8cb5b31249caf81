"""LoRA adapters at the edge: which adapter a request's `model` names, /v1/models entries for
them, and loading or unloading adapters at run time (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, vLLM's routes, when --allow-runtime-lora-updating is given).

The gateway owns the registry: adapter name -> LoraRef. Each load gets a new id, so a reload
under the same name never meets the old version's weights or prefix-cache blocks; the executors
load an adapter's weights the first time a request names its id. Adapters are checked here
(lora_files.read_adapter), so a bad one is a 400 with the reason and nothing reaches the
engine.
"""
from __future__ import annotations

import itertools
import os

import msgspec
from aiohttp import web

from pagewire.wire.lora import LoraRef

from ..lora_files import InvalidAdapter, adapter_digest, parse_module, read_adapter
from .protocol import ApiError, decode_body


class LoadBody(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False       # replace an adapter loaded under this name


class UnloadBody(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


class LoraRoutes:
    def __init__(self, gateway):
        self.gateway, self.config = gateway, gateway.config
        self.ids = itertools.count(1)
        self.adapters: dict[str, LoraRef] = {}
        for name, path in map(parse_module, self.config.lora.lora_modules):   # checked at start
            self.adapters[name] = LoraRef(name, next(self.ids), path, adapter_digest(path))

    def routes(self) -> list:
        return [web.post("/v1/load_lora_adapter", self.load),
                web.post("/v1/unload_lora_adapter", self.unload)]

    def lookup(self, model: str | None) -> LoraRef | None:
        """The adapter `model` names; None for the base model. 404 for any other name."""
        if model is None or model == self.gateway.model_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    def model_entries(self, created: int) -> list[dict]:
        return [{"id": ref.name, "object": "model", "created": created, "owned_by": "pagewire",
                 "root": ref.path, "parent": self.gateway.model_name,
                 "max_model_len": self.config.model.max_model_len}
                for ref in self.adapters.values()]

    def _check_updating(self) -> None:
        if not self.config.lora.enable_lora:
            raise ApiError(400, "LoRA adapters need a server started with --enable-lora")
        if not self.config.lora.allow_runtime_lora_updating:
            raise ApiError(404, "loading adapters at run time is off (start the server with "
                           "--allow-runtime-lora-updating)")

    async def load(self, request: web.Request) -> web.Response:
        self._check_updating()
        body = decode_body(await request.read(), LoadBody)
        if body.lora_name == self.gateway.model_name:
            raise ApiError(400, "an adapter cannot take the base model's name", "lora_name")
        if body.lora_name in self.adapters and not body.load_inplace:
            raise ApiError(400, f"The lora adapter '{body.lora_name}' has already been loaded "
                           "(load_inplace replaces it).", "lora_name")
        root = self.config.lora.lora_root
        path = os.path.realpath(body.lora_path)
        if root is not None and os.path.commonpath([path, os.path.realpath(root)]) != \
                os.path.realpath(root):
            raise ApiError(400, f"{body.lora_path} is outside --lora-root {root}", "lora_path")
        try:
            read_adapter(path, self.config.model.model_info, self.config.lora.max_lora_rank)
        except InvalidAdapter as e:
            raise ApiError(400, str(e), "lora_path") from None
        self.adapters[body.lora_name] = LoraRef(body.lora_name, next(self.ids), path,
                                                adapter_digest(path))
        return web.json_response({"message": f"Success: LoRA adapter '{body.lora_name}' "
                                             "added successfully."})

    async def unload(self, request: web.Request) -> web.Response:
        self._check_updating()
        body = decode_body(await request.read(), UnloadBody)
        if self.adapters.pop(body.lora_name, None) is None:
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                           "lora_name", "NotFoundError")
        return web.json_response({"message": f"Success: LoRA adapter '{body.lora_name}' "
                                             "removed successfully."})
