"""LoRA adapters on disk, read and checked without torch (the gateway and the offline API
refuse a bad adapter before any request runs with it; the executor loads only what passed).

An adapter is a PEFT directory: adapter_config.json and adapter_model.safetensors holding
`base_model.model.model.layers.N.{self_attn,mlp}.P.lora_{A,B}.weight` for projections P among
q/k/v/o and gate/up/down: A [r, in], B [out, r]. Its delta to P's output is
scale * x A^T B^T, scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). Which projections an
architecture's adapters may hold, and under which names, is lora_names.py's: a mixture's
experts too (gpt-oss's stacks as PEFT's target_parameters adapts them), the GPT family's and
the vision models' language model's under their own module names.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

from . import lora_names
from .model_info import ModelInfo

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRARequest:
    """The offline API's adapter choice, as vLLM spells it: LLM.generate(..., lora_request=
    LoRARequest("name", 1, "/path/to/adapter"))."""
    lora_name: str
    lora_int_id: int
    lora_path: str


class InvalidAdapter(ValueError):
    """An adapter this engine cannot serve, with the reason."""


@dataclass(frozen=True)
class AdapterFile:
    path: str
    rank: int
    scale: float
    # (layer, projection) -> (A's shape, B's shape), every pair complete
    shapes: dict[tuple[int, str], tuple[tuple[int, int], tuple[int, int]]]
    # (layer, projection) -> the file's module name (its tensors: NAME.lora_A.weight, ...)
    modules: dict[tuple[int, str], str]


def projection_shapes(info: ModelInfo) -> dict[str, tuple[int, int]]:
    """Each attention and dense-MLP projection's weight shape (out, in) in the base model."""
    return {p: lora_names.shape(info, p) for p in lora_names.ATTENTION + lora_names.MLP}


def read_adapter(path: str, info: ModelInfo, max_rank: int) -> AdapterFile:
    """The adapter at `path`, checked against the base model; InvalidAdapter says why not."""
    if not os.path.isdir(path):
        raise InvalidAdapter(f"{path}: no such adapter directory")
    config = _config(path, info.architecture)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise InvalidAdapter(f"{path}: adapter_config.json needs a positive integer r and "
                             "lora_alpha")
    if rank > max_rank:
        raise InvalidAdapter(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise InvalidAdapter(f"{path}: target_parameters must be a list of names")
    shapes, modules = _tensor_shapes(path, info, rank,
                                     lora_names.fused_experts(targets, info))
    return AdapterFile(path, rank, float(scale), shapes, modules)


def adapter_digest(path: str) -> str:
    """The adapter's content, hashed: what its prefix-cache blocks are salted with, so blocks
    kept past a restart (the disk KV tier) are found again by the same adapter only."""
    digest = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def _config(path: str, architecture: str) -> dict:
    try:
        with open(os.path.join(path, CONFIG)) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise InvalidAdapter(f"{path}: no {CONFIG}") from None
    except ValueError as e:
        raise InvalidAdapter(f"{path}: {CONFIG} is not JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"{path}: peft_type {config['peft_type']} is not LORA")
    unsupported = [(config.get("use_dora"), "DoRA"),
                   (config.get("modules_to_save"), "modules_to_save"),
                   (config.get("bias", "none") != "none", f"bias {config.get('bias')!r}"),
                   # GPT-2's Conv1D: A and B keep nn.Linear's shapes all the same
                   (config.get("fan_in_fan_out") and architecture != "GPT2LMHeadModel",
                    "fan_in_fan_out"),
                   (config.get("rank_pattern") or config.get("alpha_pattern"),
                    "per-module ranks (rank_pattern / alpha_pattern)")]
    for present, what in unsupported:
        if present:
            raise InvalidAdapter(f"{path}: {what} is not supported")
    return config


def _tensor_shapes(path: str, info: ModelInfo, rank: int,
                   fused: dict[str, tuple[int, str]]) -> tuple[dict, dict]:
    """Each adapted (layer, projection)'s (A, B) shapes, checked, and its module's name
    (`fused`: gpt-oss's expert stacks, lora_names.fused_experts)."""
    header = _safetensors_header(path)
    found: dict[tuple[int, str], dict[str, tuple[int, int]]] = {}
    modules: dict[tuple[int, str], str] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        tensor = lora_names.parse(name, info, fused)
        if isinstance(tensor, str):
            raise InvalidAdapter(f"{path}: tensor {name}: {tensor}")
        if tensor.layer >= info.num_layers:
            raise InvalidAdapter(f"{path}: {name}: the base model has {info.num_layers} layers")
        out, inp = lora_names.shape(info, tensor.proj)
        ranks = rank * lora_names.stacked(info, tensor.proj)
        want = (ranks, inp) if tensor.which == "A" else (out, ranks)
        if tuple(meta["shape"]) != want:
            raise InvalidAdapter(f"{path}: {name} has shape {meta['shape']}, the base model "
                                 f"needs {list(want)}")
        found.setdefault((tensor.layer, tensor.proj), {})[tensor.which] = want
        modules[(tensor.layer, tensor.proj)] = tensor.module
    if not found:
        raise InvalidAdapter(f"{path}: {WEIGHTS} holds no LoRA weights")
    half = [f"layer {k[0]} {k[1]}" for k, v in found.items() if len(v) != 2]
    if half:
        raise InvalidAdapter(f"{path}: only one of lora_A / lora_B for {', '.join(half)}")
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}, modules


def _safetensors_header(path: str) -> dict:
    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise InvalidAdapter(f"{path}: no {WEIGHTS}" + (
            " (adapter_model.bin is pickled and is refused: convert it to safetensors)"
            if pickled else ""))
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError("header too large")
            return json.loads(f.read(size))
    except (ValueError, struct.error) as e:
        raise InvalidAdapter(f"{file}: not a safetensors file ({e})") from None


def parse_module(text: str) -> tuple[str, str]:
    """--lora-modules: `name=path`, or JSON {"name", "path"[, "base_model_name"]}."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
            return str(value["name"]), str(value["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--lora-modules {text}: expected JSON with name and path") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text}: expected name=path")
    return name, path


def check_options(config, info: ModelInfo) -> None:
    """The LoRA options fit together, and every --lora-modules adapter can be served."""
    if config.lora.lora_modules and not config.lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if not config.lora.enable_lora:
        return
    if config.lora.max_loras < 1 or config.lora.max_lora_rank < 1:
        raise ValueError("--max-loras and --max-lora-rank must be positive")
    if config.lora.max_cpu_loras is not None and config.lora.max_cpu_loras < config.lora.max_loras:
        raise ValueError("--max-cpu-loras must be at least --max-loras")
    names = [parse_module(m)[0] for m in config.lora.lora_modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    for name, path in map(parse_module, config.lora.lora_modules):
        try:
            read_adapter(path, info, config.lora.max_lora_rank)
        except InvalidAdapter as e:
            raise ValueError(f"--lora-modules {name}: {e}") from None
