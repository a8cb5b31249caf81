"""The GPT family's Hugging Face tensors -> the decoder's state dict (weights.py does the Llama
family's): GPT-NeoX's fused QKV, whose rows go head by head (q, k, v of head 0, then of head
1, ...), reordered to all q, all k, all v; GPT-2's Conv1D weights, stored [in, out],
transposed; LayerNorm biases beside their weights."""
from __future__ import annotations

import torch

from .model_config import LlamaConfig

# (Hugging Face prefix of layer i, of the top) and each of our names' source, per family.
_NEOX = {"embed": "gpt_neox.embed_in", "norm": "gpt_neox.final_layer_norm",
         "lm_head": "embed_out", "layer": "gpt_neox.layers.{i}.",
         "input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
         "attn.qkv": "attention.query_key_value", "attn.o_proj": "attention.dense",
         "mlp.up": "mlp.dense_h_to_4h", "mlp.down": "mlp.dense_4h_to_h"}
_GPT2 = {"embed": "transformer.wte", "norm": "transformer.ln_f", "lm_head": "lm_head",
         "pos_embed": "transformer.wpe", "layer": "transformer.h.{i}.",
         "input_norm": "ln_1", "post_norm": "ln_2", "attn.qkv": "attn.c_attn",
         "attn.o_proj": "attn.c_proj", "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}
_LINEARS = ("attn.qkv", "attn.o_proj", "mlp.up", "mlp.down")
_NORMS = ("input_norm", "post_norm")


def _names(cfg: LlamaConfig) -> dict[str, str]:
    return _NEOX if cfg.architecture == "GPTNeoXForCausalLM" else _GPT2


def fuse_gpt_weights(weights: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Their names -> this decoder's state dict (weights and biases)."""
    names, gpt2 = _names(cfg), cfg.architecture == "GPT2LMHeadModel"
    out = {}
    for ours in ("embed", "pos_embed", "norm"):
        for kind in ("weight", "bias"):
            if ours in names and f"{names[ours]}.{kind}" in weights:
                out[f"{ours}.{kind}"] = weights[f"{names[ours]}.{kind}"]
    head = f"{names['lm_head']}.weight"
    out["lm_head.weight"] = out["embed.weight"] if cfg.tie_word_embeddings or head not in \
        weights else weights[head]
    for i in range(cfg.num_layers):
        src = names["layer"].format(i=i)
        for ours in (*_NORMS, *_LINEARS):
            for kind in ("weight", "bias"):
                w = weights.get(f"{src}{names[ours]}.{kind}")
                if w is None:
                    continue
                if gpt2 and kind == "weight" and ours in _LINEARS:
                    w = w.t().contiguous()                      # Conv1D: [in, out]
                elif not gpt2 and ours == "attn.qkv":
                    w = _neox_qkv(w, cfg.num_heads)
                out[f"layers.{i}.{ours}.{kind}"] = w
    return out


def gpt_linear_sources(cfg: LlamaConfig) -> dict[str, list[str]]:
    """Each Linear -> its Hugging Face weight (for loaders keeping stored blocks)."""
    names = _names(cfg)
    out = {"lm_head": [f"{names['embed' if cfg.tie_word_embeddings else 'lm_head']}.weight"]}
    for i in range(cfg.num_layers):
        src = names["layer"].format(i=i)
        out.update((f"layers.{i}.{ours}", [f"{src}{names[ours]}.weight"]) for ours in _LINEARS)
    return out


def gpt_row_orders(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Linears whose stored rows fuse_gpt_weights reorders -> that order (the rows of the
    stored weight, in ours), for loaders that keep blocks as stored: GPT-NeoX's QKV."""
    if cfg.architecture != "GPTNeoXForCausalLM":
        return {}
    rows = _neox_qkv(torch.arange(3 * cfg.num_heads * cfg.head_dim), cfg.num_heads)
    return {f"layers.{i}.attn.qkv": rows for i in range(cfg.num_layers)}


def _neox_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head][q, k, v][d] (weight [3 H, hidden] or bias [3 H]) -> [q, k, v][head][d]."""
    return w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
