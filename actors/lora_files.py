"""LoRA adapters on disk, read and checked without torch (the gateway and the offline API
refuse a bad adapter before any request runs with it; the executor loads only what passed).

An adapter is a PEFT directory: adapter_config.json and adapter_model.safetensors holding
`base_model.model.model.layers.N.{self_attn,mlp}.P.lora_{A,B}.weight` for projections P among
q/k/v/o and gate/up/down: A [r, in], B [out, r]. Its delta to P's output is
scale * x A^T B^T, scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). Which projections an
architecture's adapters may hold is `adaptable()`'s: a mixture of experts', Phi-2's and
Starcoder2's their attention's only (PEFT's default targets for them: q_proj, v_proj).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass

from .architectures import LORA_ATTENTION_ONLY, MOE_ARCHITECTURES
from .model_info import ModelInfo

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TENSOR = re.compile(r"(base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))"
                    r"\.lora_([AB])\.weight")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# the file's name of a projection where it is not ours (Phi-2 names its attention's output
# `dense`)
_THEIR_NAMES = {"PhiForCausalLM": {"dense": "o_proj"}}


def adaptable(architecture: str) -> tuple[str, ...]:
    """The projections an adapter of `architecture` may hold: the attention's only where the
    MLP is a mixture of experts (experts take no adapters yet) or the GPT family's plain
    MLP (no slot for it yet); else every one."""
    return ATTENTION if architecture in LORA_ATTENTION_ONLY else ATTENTION + MLP


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
    """Each projection's weight shape (out, in) in the base model."""
    h, q, kv, i = info.hidden_size, info.num_heads * info.head_dim, \
        info.num_kv_heads * info.head_dim, info.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def read_adapter(path: str, info: ModelInfo, max_rank: int) -> AdapterFile:
    """The adapter at `path`, checked against the base model; InvalidAdapter says why not."""
    if not os.path.isdir(path):
        raise InvalidAdapter(f"{path}: no such adapter directory")
    config = _config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise InvalidAdapter(f"{path}: adapter_config.json needs a positive integer r and "
                             "lora_alpha")
    if rank > max_rank:
        raise InvalidAdapter(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes, modules = _tensor_shapes(path, info, rank)
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


def _config(path: str) -> dict:
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
                   (config.get("fan_in_fan_out"), "fan_in_fan_out"),
                   (config.get("rank_pattern") or config.get("alpha_pattern"),
                    "per-module ranks (rank_pattern / alpha_pattern)")]
    for present, what in unsupported:
        if present:
            raise InvalidAdapter(f"{path}: {what} is not supported")
    return config


def _tensor_shapes(path: str, info: ModelInfo, rank: int) -> tuple[dict, dict]:
    """Each adapted (layer, projection)'s (A, B) shapes, checked, and its module's name."""
    header = _safetensors_header(path)
    expected = projection_shapes(info)
    found: dict[tuple[int, str], dict[str, tuple[int, int]]] = {}
    modules: dict[tuple[int, str], str] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        module, layer, proj, which = _parse(path, name, info.architecture)
        if layer >= info.num_layers:
            raise InvalidAdapter(f"{path}: {name}: the base model has {info.num_layers} layers")
        out, inp = expected[proj]
        want = (rank, inp) if which == "A" else (out, rank)
        if tuple(meta["shape"]) != want:
            raise InvalidAdapter(f"{path}: {name} has shape {meta['shape']}, the base model "
                                 f"needs {list(want)}")
        found.setdefault((layer, proj), {})[which] = want
        modules[(layer, proj)] = module
    if not found:
        raise InvalidAdapter(f"{path}: {WEIGHTS} holds no LoRA weights")
    half = [f"layer {k[0]} {k[1]}" for k, v in found.items() if len(v) != 2]
    if half:
        raise InvalidAdapter(f"{path}: only one of lora_A / lora_B for {', '.join(half)}")
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}, modules


def _parse(path: str, name: str, architecture: str) -> tuple[str, int, str, str]:
    """A tensor's (module, layer, our projection, "A" or "B"), or InvalidAdapter naming what
    this architecture's adapters may hold."""
    match = TENSOR.fullmatch(name)
    allowed = adaptable(architecture)
    proj = None
    if match is not None:
        theirs = match.group(4)
        proj = _THEIR_NAMES.get(architecture, {}).get(theirs, theirs)
        kind = "self_attn" if proj in ATTENTION else "mlp"
        proj = proj if proj in allowed and kind == match.group(3) else None
    if proj is None:
        what, why = "q/k/v/o or gate/up/down", ""
        if allowed == ATTENTION:
            what = "q/k/v/o"
            why = "; a mixture of experts' experts and router take none yet" \
                if architecture in MOE_ARCHITECTURES else "; its MLP takes none yet"
        raise InvalidAdapter(f"{path}: tensor {name} is not a LoRA A or B of {what} "
                             f"(embeddings, LM head, biases: not supported{why})")
    return match.group(1), int(match.group(2)), proj, match.group(5)


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
