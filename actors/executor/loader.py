"""Weights from GGUF files and Hugging Face safetensors directories, into a model module.

Both sources are first mapped to Hugging Face tensor names, so each model class has one
`fuse_weights` for both. GGUF tensors are dequantized at load for now.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch
from torch import nn

from pagewire.gguf_header import GGUFHeader, TensorInfo, read_gguf_header
from pagewire.model_info import ModelInfo

from .models import MODELS
from .parallel import TensorParallel, shard_state

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}


def load_model(info: ModelInfo, dtype: str, tp: TensorParallel | None = None) -> nn.Module:
    """Build the model for `info` and fill it with weights cast to `dtype` (this rank's share
    of them under tensor parallelism)."""
    if info.architecture not in MODELS:
        raise ValueError(f"architecture {info.architecture} is not supported "
                         f"(supported: {', '.join(sorted(MODELS))})")
    model_cls = MODELS[info.architecture]
    if info.format == "gguf":
        header = read_gguf_header(info.path)
        cfg = model_cls.config_class.from_gguf(header.metadata, "output.weight" in header.tensors)
        weights = read_gguf_weights(info.path, header, cfg)
    else:
        with open(os.path.join(info.path, "config.json")) as f:
            cfg = model_cls.config_class.from_hf(json.load(f))
        weights = read_safetensors(info.path)
    torch_dtype = _DTYPES[dtype]
    with torch.device("meta"):
        model = model_cls(cfg, tp)
    state = shard_state(model_cls.fuse_weights(weights, cfg), cfg, tp or TensorParallel())
    state = {k: w.to(torch_dtype) for k, w in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"weights missing from {info.path}: {', '.join(missing[:5])}")
    model.reset_buffers()
    return model.eval()


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
    return weights


def read_gguf_weights(path: str, header: GGUFHeader, cfg) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file under Hugging Face names, dequantized to float32 (or kept
    as float16/bfloat16)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    weights = {}
    for info in header.tensors.values():
        name = _hf_name(info.name)
        if name is None:
            continue
        tensor = _read_tensor(data, info)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute_rope(tensor, cfg.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute_rope(tensor, cfg.num_kv_heads)
        weights[name] = tensor
    return weights


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, kind, suffix = parts[1], parts[2], parts[3]
        if kind not in _GGUF_LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
    if parts[0] in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def _read_tensor(data: np.memmap, info: TensorInfo) -> torch.Tensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(info.shape[:-1]))
    row_bytes = info.shape[-1] // block * type_size
    raw = data[info.offset: info.offset + rows * row_bytes]
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(raw.view(np.float32).reshape(info.shape).copy())
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(raw.view(np.float16).reshape(info.shape).copy())
    if qtype == GGMLQuantizationType.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(info.shape).copy()).view(torch.bfloat16)
    return torch.from_numpy(dequantize(raw.reshape(rows, row_bytes), qtype).reshape(info.shape))


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's two rotary halves; undo it so the weights
    match Hugging Face's rotate-half layout."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
