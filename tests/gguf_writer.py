"""Write Hugging Face weights as a GGUF file the way llama.cpp's converter does, for tests.

Tensor names come from gguf-py's own TensorNameMap (llama.cpp's table, not ours); Q and K are
permuted for arch llama and gemma norms stored plus one, as convert_hf_to_gguf.py does; the
tokenizer (and chat template) is copied from the default model's GGUF file."""
from __future__ import annotations

import numpy as np
import torch

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.chat_template")


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_metadata(writer, arch: str, cfg: dict, vocab_size: int) -> None:
    heads = cfg["num_attention_heads"]
    writer.add_context_length(cfg.get("max_position_embeddings", 1024))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)          # Gemma3: the global layers' rope
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    writer.add_rope_freq_base(float(theta))
    writer.add_vocab_size(vocab_size)
    if arch in ("gemma2", "gemma3") and cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def _copy_tokenizer(writer, tokenizer_meta: dict) -> None:
    from gguf import GGUFValueType
    for key in TOKENIZER_KEYS:
        if key not in tokenizer_meta:
            continue
        value = tokenizer_meta[key]
        if isinstance(value, np.ndarray):
            writer.add_array(key, value.tolist())
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_key_value(key, int(value), GGUFValueType.UINT32)


def _to_gguf_tensor(name: str, w: torch.Tensor, arch: str, cfg: dict) -> np.ndarray:
    a = w.detach().float().numpy()
    heads = cfg["num_attention_heads"]
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        a = llama_cpp_permute(a, heads)
    elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        a = llama_cpp_permute(a, cfg.get("num_key_value_heads") or heads)
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        a = a + 1
    return np.ascontiguousarray(a, dtype=np.float32)


def quantize_iq4_nl(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 -> IQ4_NL blocks uint8 [rows, cols / 32 * 18] (gguf-py has no
    quantizer for it): d = max |w| / 127 per 32 values (float16), each value the nearest of
    d * level. Nibbles in GGML's order: values 0-15 low, 16-31 high."""
    from pagewire.kernels.quant import IQ4_NL_LEVELS
    levels = np.array(IQ4_NL_LEVELS, dtype=np.float32)
    b = a.reshape(a.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / 127).astype(np.float16)
    scaled = b / np.where(d == 0, 1, d.astype(np.float32))
    idx = np.abs(scaled[..., None] - levels).argmin(axis=-1).astype(np.uint8)   # [r, nb, 32]
    qs = idx[..., :16] | (idx[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], axis=-1).reshape(a.shape[0], -1)


def write_gguf(path: str, arch: str, state: dict[str, torch.Tensor], cfg: dict,
               tokenizer_meta: dict, qtype: str = "F32",
               raw: dict[str, np.ndarray] | None = None) -> str:
    """Write `state` (Hugging Face names, a model config dict) as GGUF arch `arch`, with 2-D
    weights stored as `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL) and 1-D ones as
    F32; `raw`
    adds float32 tensors under GGUF names (rope_freqs.weight, ...)."""
    import gguf
    from gguf.quants import quantize

    kind = gguf.GGMLQuantizationType[qtype]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, arch)
    _add_metadata(writer, arch, cfg, cfg["vocab_size"])
    _copy_tokenizer(writer, tokenizer_meta)
    for name, w in state.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no name for {name}"
        a = _to_gguf_tensor(name, w, arch, cfg)
        if a.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, a)
        elif kind in (gguf.GGMLQuantizationType.F16,):
            writer.add_tensor(gguf_name, a.astype(np.float16))
        else:
            blocks = quantize_iq4_nl(a) if qtype == "IQ4_NL" else quantize(a, kind)
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
    for gguf_name, a in (raw or {}).items():
        writer.add_tensor(gguf_name, np.ascontiguousarray(a, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
