"""Write Hugging Face weights as a GGUF file the way llama.cpp's converter does (tests, bench).

Tensor names come from gguf-py's own TensorNameMap (llama.cpp's table, not ours); Q and K are
permuted for arch llama and gemma norms stored plus one, as convert_hf_to_gguf.py does; the
tokenizer (and chat template) is copied from the default model's GGUF file."""
from __future__ import annotations

import re

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


def add_metadata(writer, arch: str, cfg: dict, vocab_size: int) -> None:
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
    if arch in ("gptneox", "gpt2", "phi2", "starcoder2"):    # LayerNorms
        writer.add_layer_norm_eps(cfg.get("layer_norm_eps") or cfg.get("layer_norm_epsilon")
                                  or cfg.get("norm_epsilon") or 1e-5)
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                        cfg.get("rotary_pct", 1.0))
        writer.add_rope_dimension_count(int(head_dim * factor))
        if arch == "gptneox":
            writer.add_parallel_residual(cfg.get("use_parallel_residual", True))
    else:
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
    if arch == "gpt-oss":
        _gpt_oss_metadata(writer, cfg)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _gpt_oss_metadata(writer, cfg: dict) -> None:
    """What convert_hf_to_gguf.py's GptOssModel adds: the window, the experts' width, yarn
    (llama.cpp's alternation of sliding and full layers and the SwiGLU's limit are its own)."""
    import gguf
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def gpt_oss_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's expert stacks as llama.cpp's converter writes them: gate_up_proj [E, H, 2I]
    (x @ W, gate and up interleaved by column) -> gate_proj and up_proj [E, I, H] (nn.Linear's
    layout), their biases [E, I]; down_proj [E, I, H] -> [E, H, I]. Other tensors as they are."""
    out = {}
    for name, w in state.items():
        if name.endswith("experts.gate_up_proj"):
            stem = name[:-len("gate_up_proj")]
            out[stem + "gate_proj.weight"] = w[:, :, 0::2].transpose(1, 2)
            out[stem + "up_proj.weight"] = w[:, :, 1::2].transpose(1, 2)
        elif name.endswith("experts.gate_up_proj_bias"):
            stem = name[:-len("gate_up_proj_bias")]
            out[stem + "gate_proj.bias"], out[stem + "up_proj.bias"] = w[:, 0::2], w[:, 1::2]
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = w.transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):
            out[name[:-len("_bias")] + ".bias"] = w
        else:
            out[name] = w
    return out


_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's one tensor per expert and projection -> one [experts, rows, cols] stack
    per layer and projection, named as llama.cpp's converter names its merged input
    (model.layers.0.mlp.experts.gate_proj.weight)."""
    out, stacks = {}, {}
    for name, w in state.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = w
        else:
            prefix, e, proj = match.groups()
            stacks.setdefault(f"{prefix}.{proj}.weight", {})[int(e)] = w
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def copy_tokenizer(writer, tokenizer_meta: dict) -> None:
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
    if arch == "gpt2" and a.ndim == 2 and name.startswith("transformer.h."):
        a = a.T                                  # Conv1D [in, out] -> [out, in], as llama.cpp
    return np.ascontiguousarray(a, dtype=np.float32)


def quantize_iq4_nl(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 -> IQ4_NL blocks uint8 [rows, cols / 32 * 18] (gguf-py has no
    quantizer for it): d = max |w| / 127 per 32 values (float16), each value the nearest of
    d * level. Nibbles in GGML's order: values 0-15 low, 16-31 high."""
    from pagewire.kernels.gguf_blocks import IQ4_NL_LEVELS
    levels = np.array(IQ4_NL_LEVELS, dtype=np.float32)
    b = a.reshape(a.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / 127).astype(np.float16)
    scaled = b / np.where(d == 0, 1, d.astype(np.float32))
    idx = np.abs(scaled[..., None] - levels).argmin(axis=-1).astype(np.uint8)   # [r, nb, 32]
    qs = idx[..., :16] | (idx[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], axis=-1).reshape(a.shape[0], -1)


def quantize_iq4_xs(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> IQ4_XS blocks (gguf-py has no
    quantizer for it): per 32 weights a scale max |w| / 127, a multiple (-32..31) of its
    superblock's fp16 d (the largest / 31), each weight the nearest of scale * level."""
    from pagewire.kernels.gguf_blocks import IQ4_NL_LEVELS
    levels = np.array(IQ4_NL_LEVELS, dtype=np.float32)
    b = a.reshape(-1, 8, 32).astype(np.float32)
    scale = np.abs(b).max(-1) / 127                                          # [n, 8]
    d = (scale.max(-1) / 31).astype(np.float16)
    ls = _steps(scale, d, -32, 31)                                          # [n, 8]
    step = d.astype(np.float32)[:, None] * ls
    scaled = b / np.where(step == 0, 1, step)[..., None]
    idx = np.abs(scaled[..., None] - levels).argmin(-1).astype(np.uint8)   # [n, 8, 32]
    qs = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(-1, 128)
    stored = (ls + 32).astype(np.uint16)                                    # 6 bits a block
    high = ((stored >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
    low = (stored[:, 0::2] & 0x0F) | ((stored[:, 1::2] & 0x0F) << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2),
                           low.astype(np.uint8), qs], axis=1).reshape(a.shape[0], -1)


def pack_q4_k(d, dmin, sc, mn, q) -> np.ndarray:
    """ggml's block_q4_K from its parts: d, dmin [n] f16; sc, mn [n, 8] 6-bit; q [n, 256]
    4-bit."""
    n = d.shape[0]
    scales = np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                             (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=1)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                           scales.astype(np.uint8), qs.astype(np.uint8)], axis=1)


def pack_q6_k(d, scales, q) -> np.ndarray:
    """ggml's block_q6_K: d [n] f16; scales [n, 16] int8; q [n, 256] in -32..31."""
    n = d.shape[0]
    u = (q + 32).astype(np.uint8).reshape(n, 2, 128)
    low, high = (u & 0x0F).reshape(n, 2, 2, 64), (u >> 4).reshape(n, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6))
    qh = qh.reshape(n, 64)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8),
                           d.view(np.uint8).reshape(n, 2)], axis=1)


def k_quant_from_parts(qtype: str, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(block bytes, the float32 weights they encode), from random parts."""
    d = rng.uniform(0.001, 0.01, n).astype(np.float16)
    if qtype == "Q4_K":
        dmin = rng.uniform(0.001, 0.01, n).astype(np.float16)
        sc = rng.integers(0, 64, (n, 8), dtype=np.uint8)
        mn = rng.integers(0, 64, (n, 8), dtype=np.uint8)
        q = rng.integers(0, 16, (n, 256), dtype=np.uint8)
        scale = (d.astype(np.float32)[:, None] * sc).repeat(32, axis=1)
        offset = (dmin.astype(np.float32)[:, None] * mn).repeat(32, axis=1)
        return pack_q4_k(d, dmin, sc, mn, q), scale * q.astype(np.float32) - offset
    scales = rng.integers(-128, 128, (n, 16)).astype(np.int8)
    q = rng.integers(-32, 32, (n, 256))
    scale = (d.astype(np.float32)[:, None] * scales.astype(np.float32)).repeat(16, axis=1)
    return pack_q6_k(d, scales, q), scale * q.astype(np.float32)


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> Q4_K blocks (gguf-py has no quantizer
    for it): per 32 weights a scale (max - min) / 15 and a minimum, each a 6-bit multiple of
    its superblock's fp16 d or dmin (the largest / 63); weights rounded to the nearest step."""
    b = a.reshape(-1, 8, 32).astype(np.float32)
    low, high = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    scale, minimum = (high - low) / 15, -low                                # [n, 8]
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    sc = _steps(scale, d, 0, 63)
    mn = _steps(minimum, dmin, 0, 63)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.round((b + offset[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 256)
    return pack_q4_k(d, dmin, sc, mn, q).reshape(a.shape[0], -1)


def quantize_q6_k(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> Q6_K blocks: per 16 weights a scale
    max |w| / 31, an int8 multiple of its superblock's fp16 d (the largest / 127)."""
    b = a.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31                                          # [n, 16]
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = _steps(scale, d, -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.round(b / np.where(step == 0, 1, step)[..., None])
    return pack_q6_k(d, sc, np.clip(q, -32, 31).astype(np.int64).reshape(-1, 256)) \
        .reshape(a.shape[0], -1)


def _steps(value: np.ndarray, unit: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """value [n, k] as integer multiples of unit [n] (fp16), clipped to [lo, hi]."""
    u = unit.astype(np.float32)[:, None]
    return np.clip(np.round(value / np.where(u == 0, 1, u)), lo, hi).astype(np.int64)


def write_gguf(path: str, arch: str, state: dict[str, torch.Tensor], cfg: dict,
               tokenizer_meta: dict, qtype: str = "F32",
               raw: dict[str, np.ndarray] | None = None) -> str:
    """Write `state` (Hugging Face names, a model config dict) as GGUF arch `arch`, with 2-D
    weights stored as `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL, IQ4_XS, Q4_K,
    Q6_K, or Q4_K_M: like llama.cpp's mix, Q6_K for down_proj, the LM head and layer 0's
    v_proj, else Q4_K) and 1-D ones as F32; `raw` adds float32 tensors under GGUF names (rope_freqs.weight, ...)."""
    import gguf
    from gguf.quants import quantize

    from pagewire.model_info import hf_text_config
    cfg = hf_text_config(cfg)                    # GPT-2's n_embd, ... under the usual keys
    kind = gguf.GGMLQuantizationType[tensor_type(qtype, "")]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, arch)
    add_metadata(writer, arch, cfg, cfg["vocab_size"])
    copy_tokenizer(writer, tokenizer_meta)
    if arch == "gpt-oss":
        state = gpt_oss_tensors(state)
    for name, w in stack_experts(state).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no name for {name}"
        if name.endswith("self_attn.sinks"):
            gguf_name += ".weight"                # as llama.cpp's converter names them
        a = _to_gguf_tensor(name, w, arch, cfg)
        if a.ndim == 1 or kind == gguf.GGMLQuantizationType.F32 or "ffn_gate_inp" in gguf_name \
                or name.endswith(".bias"):        # (a stack of experts' biases is 2-D)
            writer.add_tensor(gguf_name, a)      # routers stay float32, as llama.cpp keeps them
        elif kind in (gguf.GGMLQuantizationType.F16,):
            writer.add_tensor(gguf_name, a.astype(np.float16))
        else:
            stored = tensor_type(qtype, name)
            kind = gguf.GGMLQuantizationType[stored]
            rows = a.reshape(-1, a.shape[-1])                      # a stack's experts' rows
            blocks = QUANTIZERS.get(stored, lambda a: quantize(a, kind))(rows)
            writer.add_tensor(gguf_name, blocks.reshape(*a.shape[:-1], -1), raw_dtype=kind)
    for gguf_name, a in (raw or {}).items():
        writer.add_tensor(gguf_name, np.ascontiguousarray(a, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_type(qtype: str, name: str) -> str:
    """The GGML type a 2-D weight `name` (Hugging Face name) is stored as in a `qtype` file:
    `qtype` itself, except in Q4_K_M's and Q5_K_M's mixes (Q4_K or Q5_K, Q6_K where
    llama.cpp gives more bits)."""
    if qtype not in ("Q4_K_M", "Q5_K_M"):
        return qtype
    more_bits = name.endswith(("down_proj.weight", "lm_head.weight", "dense_4h_to_h.weight",
                               "embed_out.weight")) or \
        name == "model.layers.0.self_attn.v_proj.weight"
    return "Q6_K" if more_bits else qtype[:4]


QUANTIZERS = {"IQ4_NL": quantize_iq4_nl, "IQ4_XS": quantize_iq4_xs, "Q4_K": quantize_q4_k,
              "Q6_K": quantize_q6_k}

# byte offsets of each type's fp16 scales and minimums, which random bytes must not make
# infinite or NaN
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,), "IQ4_XS": (0,), "MXFP4": ()}
# byte offsets of each type's E8M0 exponents, which random bytes would make 2^-128..2^127
EXPONENT_FIELDS = {"MXFP4": (0,)}


def random_blocks(qtype: str, rows: int, cols: int, rng) -> torch.Tensor:
    """uint8 [rows, the bytes of `cols` weights] of GGML type `qtype` (its name): random
    quants and sub-block scales (every bit pattern), fp16 fields of magnitude 0.001-0.01
    (either sign), E8M0 exponents 2^-10..2^-1 (MXFP4's scale halved: fp16 holds them)."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        value = rng.uniform(0.001, 0.01, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])
        raw[:, at:at + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)
    for at in EXPONENT_FIELDS.get(qtype, ()):
        raw[:, at] = rng.integers(118, 128, raw.shape[0])
    return torch.from_numpy(raw.reshape(rows, -1))
