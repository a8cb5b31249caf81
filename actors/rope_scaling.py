"""Rope scaling and the context length it gives, read from a model's config without torch
(model_info.py; the GGUF model config, executor/models/model_config.py): Hugging Face's
rope_parameters / rope_scaling and llama.cpp's rope.scaling.* keys, both in transformers 5's
form ({"rope_type": ..., "factor": ...}; None for plain rope). Each kind named here is one
kernels/rotary.rope_inv_freq builds (a test holds the two lists equal)."""
from __future__ import annotations

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")   # kernels/rotary.rope_inv_freq
# Where Hugging Face configs put the trained context length (vLLM reads the same keys).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "max_sequence_length", "max_seq_length", "seq_len")


def hf_rope_scaling(cfg: dict, where: str = "config.json") -> dict | None:
    """The config's rope scaling in transformers 5's form (rope_type; None for plain rope),
    from `rope_parameters` or the older `rope_scaling` (where `type` may name the kind)."""
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", params.get("type", "default")) == "default":
        params = cfg.get("rope_scaling") or params     # an older config's key
    if not params:
        return None
    params = {k: v for k, v in params.items() if k != "rope_theta"}
    kind = params.pop("type", None)
    kind = params.setdefault("rope_type", kind or "default")
    if kind == "mrope":             # Qwen2.5-VL's older configs: plain rope over 3D positions
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: rope scaling {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    need = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}[kind]
    missing = [k for k in need if k not in params]
    if missing:
        raise ValueError(f"{where}: rope scaling {kind} is missing {', '.join(missing)}")
    if kind == "yarn":
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 2048))
    return params


def gguf_rope_scaling(meta: dict, arch: str) -> dict | None:
    """llama.cpp's rope.scaling.* keys in Hugging Face's form. (Llama 3's scaling travels as a
    `rope_freqs` tensor of per-frequency divisors instead, read with the weights.)"""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, yarn)")
    params = {"rope_type": kind, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        params["original_max_position_embeddings"] = int(original)
    return params


def hf_context_length(cfg: dict, rope: dict | None) -> int:
    """The longest context the config supports, as vLLM derives it: the smallest of the
    length keys present, times the rope scaling factor for scalings that extend the context
    (yarn from its original length; llama3's config already holds the extended length)."""
    lengths = [int(cfg[k]) for k in _CONTEXT_KEYS if isinstance(cfg.get(k), int)]
    length = min(lengths) if lengths else 2048
    if rope and rope["rope_type"] in ("linear", "dynamic", "yarn"):
        base = rope.get("original_max_position_embeddings", length) \
            if rope["rope_type"] == "yarn" else length
        length = int(base * rope["factor"])
    return length
