"""Which LoRA adapter a request runs with, as it crosses from the gateway to the executor."""
from __future__ import annotations

import msgspec


class LoraRef(msgspec.Struct, frozen=True, array_like=True):
    """`id` names one load of `path` under `name`: a reload under the same name gets a new id,
    so what is keyed by it (loaded weights) never mixes two versions. `digest` (of the files'
    content) salts its prefix-cache blocks: equal across loads and restarts of the same
    adapter, different for any other."""
    name: str
    id: int
    path: str
    digest: str = ""
