"""The models a front serves, from a models file or a models directory.

A models file (TOML, YAML or JSON) names each model under `models`, by the name clients pass
as `model`:

    [models.chat]
    model = "/srv/models/SmolLM2-1.7B-Instruct-Q4_0.gguf"
    pinned = true                 # loaded at start, never unloaded
    max_model_len = 4096          # any `pagewire serve` option, for this model only

    [models.embed]
    model = "/srv/models/bge-small-en"
    runner = "pooling"
    idle_timeout = 600            # this model's own --model-idle-timeout
    memory = "2GiB"               # what it holds once loaded, for the budget (else measured)

A models directory serves each `*.gguf` file (but llama.cpp's `mmproj*` vision files) under
its name without `.gguf`, and each folder holding a `config.json` under the folder's name.
Imports no torch.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field

from ..config import parse_bytes
from ..options import BY_FIELD, convert

# The front's own options: never passed on to a model's engine.
FRONT_ONLY = frozenset({"models_file", "models_dir", "model_idle_timeout",
                        "models_memory_budget", "max_loaded_models", "model_load_timeout",
                        "model_queue_size", "host", "port", "model", "served_model_name"})
ENTRY_KEYS = frozenset({"model", "pinned", "idle_timeout", "memory"})


@dataclass(frozen=True)
class ModelEntry:
    name: str                                # what clients pass as `model`
    path: str                                # a GGUF file or a model directory
    options: dict = field(default_factory=dict)   # serve options over the front's own
    pinned: bool = False                     # loaded at start; never unloaded for room or idling
    idle_timeout: float | None = None        # None: the front's --model-idle-timeout
    memory: int | None = None                # declared footprint in bytes; None: measured
    adapters: tuple[str, ...] = ()           # its --lora-modules' names (requests may name one)


def read_models_file(path: str) -> list[ModelEntry]:
    """The entries of a models file, in its order. Raises ValueError naming the file and
    the model on anything it cannot serve."""
    with open(path, "rb") as f:
        if path.endswith(".json"):
            raw = json.load(f)
        elif path.endswith((".yaml", ".yml")):
            import yaml                      # PyYAML comes with transformers
            raw = yaml.safe_load(f)
        else:
            raw = tomllib.load(f)
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f"{path}: expected a `models` table naming at least one model")
    base = os.path.dirname(os.path.abspath(path))
    return [_entry(path, str(name), spec, base) for name, spec in models.items()]


def _entry(source: str, name: str, spec, base: str) -> ModelEntry:
    where = f"{source}: model {name!r}"
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), str):
        raise ValueError(f"{where}: expected a table with `model` (a path)")
    options = {k.replace("-", "_"): v for k, v in spec.items() if k not in ENTRY_KEYS}
    unknown = sorted(k for k in options if k not in BY_FIELD or k in FRONT_ONLY)
    if unknown:
        raise ValueError(f"{where}: options a model cannot set here: {unknown}")
    for key, value in options.items():
        if BY_FIELD[key].choices and value not in BY_FIELD[key].choices:
            raise ValueError(f"{where}: {key} = {value!r}: expected one of "
                             f"{', '.join(BY_FIELD[key].choices)}")
    try:
        convert(dict(options))               # a bad value fails at start, not at first use
        memory = None if spec.get("memory") is None else parse_bytes(spec["memory"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    model_path = os.path.join(base, os.path.expanduser(spec["model"]))
    if not os.path.exists(model_path):
        raise ValueError(f"{where}: {model_path} does not exist")
    idle = spec.get("idle_timeout")
    return ModelEntry(name, model_path, options, pinned=bool(spec.get("pinned", False)),
                      idle_timeout=None if idle is None else float(idle), memory=memory,
                      adapters=tuple(adapter_names(options.get("lora_modules", []))))


def adapter_names(modules: list[str]) -> list[str]:
    """The names of --lora-modules entries (`name=path` or JSON with `name`)."""
    names = []
    for text in modules:
        if text.lstrip().startswith("{"):
            names.append(str(json.loads(text).get("name", "")))
        else:
            names.append(text.partition("=")[0])
    return [n for n in names if n]


def scan_models_dir(path: str) -> list[ModelEntry]:
    """A models directory's entries, sorted by name."""
    if not os.path.isdir(path):
        raise ValueError(f"--models-dir {path}: not a directory")
    entries = []
    for item in sorted(os.listdir(path)):
        full = os.path.join(path, item)
        if item.endswith(".gguf") and not item.startswith("mmproj") and os.path.isfile(full):
            entries.append(ModelEntry(item[:-len(".gguf")], full))
        elif os.path.isfile(os.path.join(full, "config.json")):
            entries.append(ModelEntry(item, full))
    return entries


def engine_values(front: dict, entry: ModelEntry, port: int) -> dict:
    """The options one model's engine starts with: the front's (its flags, environment and
    config file, less its own) under the entry's, then the fixed ones: the model, its name,
    a private loopback port."""
    values = {k: v for k, v in front.items() if k not in FRONT_ONLY}
    values.update(entry.options)
    values.update(model=entry.path, served_model_name=entry.name, host="127.0.0.1", port=port)
    return values


def weights_bytes(path: str) -> int:
    """The size of a model's weight files: the memory its engine will hold, before the KV
    pool and the processes' own."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    if not os.path.isdir(path):              # gone since start: its load will say so
        return 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith((".safetensors", ".bin", ".gguf", ".pt")))
