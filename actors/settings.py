"""Where a server's options come from, lowest precedence first: EngineConfig's defaults, a
config file (`--config pagewire.toml`, or .json), the environment (`PAGEWIRE_<OPTION>`, e.g.
PAGEWIRE_MAX_NUM_SEQS=64), then command-line flags. API keys are the union of every source."""
from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping

import msgspec

from .config import EngineConfig, parse_bytes

# Resolved by EngineConfig.resolve(), never set by hand.
DERIVED = {"model_info", "num_host_blocks", "run_dir", "backend"}
SETTABLE = [f for f in EngineConfig.__struct_fields__ if f not in DERIVED]


def gib(text: str | int | float) -> int:
    """vLLM's --swap-space is a number of GiB; a size with a unit is taken as it is."""
    if isinstance(text, (int, float)):
        return int(text * 2**30)
    try:
        return int(float(text) * 2**30)
    except ValueError:
        return parse_bytes(text)


_CONVERT = {"kv_cache_memory": parse_bytes, "swap_space": gib,
            "trace_segment_bytes": parse_bytes}


def from_file(path: str) -> dict:
    """Options from a TOML or JSON file; keys may use dashes (as flags) or underscores."""
    with open(path, "rb") as f:
        raw = json.load(f) if path.endswith(".json") else tomllib.load(f)
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - set(SETTABLE))
    if unknown:
        raise ValueError(f"{path}: unknown options {unknown}")
    return values


def from_env(environ: Mapping[str, str]) -> dict:
    values = {}
    for name in SETTABLE:
        text = environ.get(f"PAGEWIRE_{name.upper()}")
        if text is not None and text != "":
            values[name] = text.split(",") if name == "api_keys" else text
    return values


def env_api_keys(environ: Mapping[str, str]) -> list[str]:
    text = ",".join(environ.get(v, "") for v in ("PAGEWIRE_API_KEYS", "PAGEWIRE_API_KEY",
                                                   "VLLM_API_KEY"))
    return [k for k in text.split(",") if k]


def build(flags: dict, environ: Mapping[str, str] | None = None,
          config_file: str | None = None) -> EngineConfig:
    """The EngineConfig from every source (unresolved). Raises ValueError on a bad value."""
    environ = os.environ if environ is None else environ
    file_values = from_file(config_file) if config_file else {}
    values = {**file_values, **from_env(environ), **flags}
    values["api_keys"] = list(dict.fromkeys(
        list(file_values.get("api_keys", [])) + env_api_keys(environ)
        + list(flags.get("api_keys", []))))
    for name, convert in _CONVERT.items():
        if name in values and isinstance(values[name], str):
            values[name] = convert(values[name])
    try:
        return msgspec.convert(values, EngineConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad option: {e}") from None


def effective(config: EngineConfig) -> str:
    """The configuration as one JSON line for the log, API keys redacted."""
    values = {k: getattr(config, k) for k in SETTABLE}
    values["api_keys"] = [f"<{len(values['api_keys'])} keys>"] if values["api_keys"] else []
    return msgspec.json.encode(values).decode()
