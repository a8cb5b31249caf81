"""Where a server's options come from, lowest precedence first: EngineConfig's defaults, a
config file (`--config pagewire.toml`, or .json), the environment (`PAGEWIRE_<OPTION>`, e.g.
PAGEWIRE_MAX_NUM_SEQS=64), then command-line flags. API keys are the union of every source.
Which options there are, and how each is parsed, is declared in options.py."""
from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping

import msgspec

from .config import EngineConfig
from .options import BY_FIELD, convert, values_from_env


def from_file(path: str) -> dict:
    """Options from a TOML or JSON file; keys may use dashes (as flags) or underscores."""
    with open(path, "rb") as f:
        raw = json.load(f) if path.endswith(".json") else tomllib.load(f)
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - set(BY_FIELD))
    if unknown:
        raise ValueError(f"{path}: unknown options {unknown}")
    return values


def env_api_keys(environ: Mapping[str, str]) -> list[str]:
    text = ",".join(environ.get(v, "") for v in ("PAGEWIRE_API_KEYS", "PAGEWIRE_API_KEY",
                                                   "VLLM_API_KEY"))
    return [k for k in text.split(",") if k]


def build(flags: dict, environ: Mapping[str, str] | None = None,
          config_file: str | None = None) -> EngineConfig:
    """The EngineConfig from every source (unresolved). Raises ValueError on a bad value."""
    return convert(given(flags, environ, config_file))


def given(flags: dict, environ: Mapping[str, str] | None = None,
          config_file: str | None = None) -> dict:
    """The option values every source gives, by precedence, before defaults."""
    environ = os.environ if environ is None else environ
    file_values = from_file(config_file) if config_file else {}
    values = {**file_values, **values_from_env(environ), **flags}
    if environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1"):
        values.setdefault("allow_runtime_lora_updating", True)    # vLLM's switch
    values["api_keys"] = list(dict.fromkeys(
        list(file_values.get("api_keys", [])) + env_api_keys(environ)
        + list(flags.get("api_keys", []))))
    return values


def effective(config: EngineConfig) -> str:
    """The configuration as one JSON line for the log, API keys redacted."""
    values = {k: config.get(k) for k in BY_FIELD}
    values["api_keys"] = [f"<{len(values['api_keys'])} keys>"] if values["api_keys"] else []
    return msgspec.json.encode(values).decode()
