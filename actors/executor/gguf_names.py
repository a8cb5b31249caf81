"""llama.cpp's tensor names -> Hugging Face's, per GGUF architecture, and the parts a stored
tensor splits into where Hugging Face keeps several: a stack of experts [E, rows, cols]
("{e}": one per expert) and Phi-2's fused QKV in older files ("{p}": q, k and v by rows)."""
from __future__ import annotations

from pagewire.gguf_header import TensorInfo

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 and 3 have four norms per layer: ffn_norm is the one before the MLP there.
_GEMMA2_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# Mixtures of experts: llama.cpp stacks a layer's experts in one 3-D tensor per projection
# ([experts, rows, cols]); "{e}" stands for the expert each slice becomes.
_MOE_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "mlp.gate",
              "ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
              "ffn_down_exps": "mlp.experts.{e}.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
              "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_MIXTRAL_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate",     # GGUF arch llama
                  "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                  "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                  "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}
# GPT-NeoX (its fused QKV as the converter leaves it: head by head, as Hugging Face's).
_NEOX_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
               "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
# GPT-2 (its Conv1D weights stored [out, in], transposed back by gguf_weights), Phi-2 (older
# files fuse its q, k and v: "{p}", see tensor_parts) and Starcoder2.
_GPT2_NAMES = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn",
               "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_PHI2_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_qkv": "self_attn.{p}_proj", "attn_output": "self_attn.dense",
               "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_STARCODER2_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# gpt-oss: its norm before the MLP is post_attention_norm; gate and up de-interleaved by the
# converter into stacks of their own (with biases [E, rows]); sinks "blk.N.attn_sinks.weight".
_GPT_OSS_NAMES = {**{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
                  "post_attention_norm": "post_attention_layernorm",
                  "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                  "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                  "ffn_up_exps": "mlp.experts.{e}.up_proj",
                  "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
LAYER_NAMES = {"llama": _MIXTRAL_NAMES, "qwen2": _LAYER_NAMES, "qwen3": _LAYER_NAMES,
               "gemma": _LAYER_NAMES, "gemma2": _GEMMA2_LAYER_NAMES,
               "gemma3": _GEMMA2_LAYER_NAMES, "qwen2moe": _MOE_NAMES, "qwen3moe": _MOE_NAMES,
               "olmoe": _MOE_NAMES, "gptneox": _NEOX_NAMES, "gpt2": _GPT2_NAMES,
               "phi2": _PHI2_NAMES, "starcoder2": _STARCODER2_NAMES, "gpt-oss": _GPT_OSS_NAMES}
# Where an architecture's Hugging Face names differ from Llama's: its layers' prefix and
# top-level tensors.
_LAYER_PREFIX = {"gptneox": "gpt_neox.layers", "gpt2": "transformer.h"}
_ARCH_TOP_NAMES = {"gptneox": {"token_embd": "gpt_neox.embed_in",
                               "output_norm": "gpt_neox.final_layer_norm",
                               "output": "embed_out"},
                   "gpt2": {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                            "output_norm": "transformer.ln_f", "output": "lm_head"},
                   "phi2": {**_TOP_NAMES, "output_norm": "model.final_layernorm"}}
# GGUF architectures whose linears Hugging Face stores as Conv1D ([in, out]).
CONV1D = {"gpt2"}
ROPE_PERMUTED = {"llama"}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for tensors the
    model does not use (rope_freqs, ...). A name holding "{e}" or "{p}" is split (tensor_parts)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        kind = LAYER_NAMES[arch].get(parts[2])
        prefix = _LAYER_PREFIX.get(arch, "model.layers")
        return None if kind is None else f"{prefix}.{parts[1]}.{kind}.{parts[3]}"
    top = _ARCH_TOP_NAMES.get(arch, _TOP_NAMES)
    if len(parts) == 2 and parts[0] in top:
        return f"{top[parts[0]]}.{parts[1]}"
    return None


def tensor_parts(name: str, info: TensorInfo, num_heads: int,
                 num_kv_heads: int) -> list[tuple[str, int | slice]]:
    """(Hugging Face name, index into the stored tensor) of each part of a tensor whose name
    holds "{e}" (an expert of a stack [E, rows, cols]) or "{p}" (q, k, v: slices of a fused
    QKV's rows, or of its bias); [] for a tensor kept whole."""
    if "{e}" in name:
        return [(name.format(e=e), e) for e in range(info.shape[0])]
    if "{p}" not in name:
        return []
    head_dim = info.shape[0] // (num_heads + 2 * num_kv_heads)
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return [(name.format(p="q"), slice(0, q)), (name.format(p="k"), slice(q, q + kv)),
            (name.format(p="v"), slice(q + kv, q + 2 * kv))]
