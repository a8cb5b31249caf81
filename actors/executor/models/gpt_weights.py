"""The GPT family's Hugging Face tensors -> the decoder's state dict (weights.py does the Llama
family's): GPT-NeoX's fused QKV, whose rows go head by head (q, k, v of head 0, then of head
1, ...), reordered to all q, all k, all v; GPT-2's Conv1D weights, stored [in, out],
transposed; separate q, k and v (GPT-J, Phi-2, Starcoder2) joined; GPT-J's q and k rows put
in rotate-half order (its rope rotates interleaved pairs: the same rotation of the same
pairs, so the scores are unchanged); one norm in both norms' places where attention and MLP
read the same normed input (GPT-J, Phi-2); LayerNorm and LM-head biases beside their
weights."""
from __future__ import annotations

import torch

from .model_config import LlamaConfig

# Per family: the Hugging Face prefix of layer i and of the top tensors, and each of our
# names' source (a tuple: sources joined by rows).
_QKV = ("q_proj", "k_proj", "v_proj")
_NEOX = {"embed": "gpt_neox.embed_in", "norm": "gpt_neox.final_layer_norm",
         "lm_head": "embed_out", "layer": "gpt_neox.layers.{i}.",
         "input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
         "attn.qkv": "attention.query_key_value", "attn.o_proj": "attention.dense",
         "mlp.up": "mlp.dense_h_to_4h", "mlp.down": "mlp.dense_4h_to_h"}
_GPT2 = {"embed": "transformer.wte", "norm": "transformer.ln_f", "lm_head": "lm_head",
         "pos_embed": "transformer.wpe", "layer": "transformer.h.{i}.",
         "input_norm": "ln_1", "post_norm": "ln_2", "attn.qkv": "attn.c_attn",
         "attn.o_proj": "attn.c_proj", "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}
_GPTJ = {"embed": "transformer.wte", "norm": "transformer.ln_f", "lm_head": "lm_head",
         "layer": "transformer.h.{i}.", "input_norm": "ln_1", "post_norm": "ln_1",
         "attn.qkv": tuple(f"attn.{p}" for p in _QKV), "attn.o_proj": "attn.out_proj",
         "mlp.up": "mlp.fc_in", "mlp.down": "mlp.fc_out"}
_PHI = {"embed": "model.embed_tokens", "norm": "model.final_layernorm", "lm_head": "lm_head",
        "layer": "model.layers.{i}.", "input_norm": "input_layernorm",
        "post_norm": "input_layernorm", "attn.qkv": tuple(f"self_attn.{p}" for p in _QKV),
        "attn.o_proj": "self_attn.dense", "mlp.up": "mlp.fc1", "mlp.down": "mlp.fc2"}
_STARCODER2 = {"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head",
               "layer": "model.layers.{i}.", "input_norm": "input_layernorm",
               "post_norm": "post_attention_layernorm",
               "attn.qkv": tuple(f"self_attn.{p}" for p in _QKV),
               "attn.o_proj": "self_attn.o_proj", "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}
_FAMILIES = {"GPTNeoXForCausalLM": _NEOX, "GPT2LMHeadModel": _GPT2, "GPTJForCausalLM": _GPTJ,
             "PhiForCausalLM": _PHI, "Starcoder2ForCausalLM": _STARCODER2}
_LINEARS = ("attn.qkv", "attn.o_proj", "mlp.up", "mlp.down")
_NORMS = ("input_norm", "post_norm")


def _names(cfg: LlamaConfig) -> dict:
    return _FAMILIES[cfg.architecture]


def _sources(names: dict, ours: str) -> tuple[str, ...]:
    src = names[ours]
    return src if isinstance(src, tuple) else (src,)


def gpt_embedding_source(cfg: LlamaConfig) -> str:
    return f"{_names(cfg)['embed']}.weight"


def fuse_gpt_weights(weights: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Their names -> this decoder's state dict (weights and biases). A Linear whose
    sources are absent (the loader skips those that keep only their blocks) gets no weight."""
    names, gpt2 = _names(cfg), cfg.architecture == "GPT2LMHeadModel"
    orders = gpt_row_orders(cfg)
    out = {}
    for ours in ("embed", "pos_embed", "norm", "lm_head"):
        for kind in ("weight", "bias"):
            if ours in names and f"{names[ours]}.{kind}" in weights:
                out[f"{ours}.{kind}"] = weights[f"{names[ours]}.{kind}"]
    if cfg.tie_word_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    for i in range(cfg.num_layers):
        src, dst = names["layer"].format(i=i), f"layers.{i}."
        for ours in (*_NORMS, *_LINEARS):
            for kind in ("weight", "bias"):
                parts = [weights.get(f"{src}{name}.{kind}") for name in _sources(names, ours)]
                if any(p is None for p in parts):
                    continue
                w = torch.cat(parts) if len(parts) > 1 else parts[0]
                if gpt2 and kind == "weight" and ours in _LINEARS:
                    w = w.t().contiguous()                      # Conv1D: [in, out]
                if dst + ours in orders:
                    w = w[orders[dst + ours]]
                out[f"{dst}{ours}.{kind}"] = w
    return out


def gpt_linear_sources(cfg: LlamaConfig) -> dict[str, list[str]]:
    """Each Linear -> the Hugging Face weights it joins by rows (for loaders keeping stored
    blocks)."""
    names = _names(cfg)
    out = {"lm_head": [f"{names['embed' if cfg.tie_word_embeddings else 'lm_head']}.weight"]}
    for i in range(cfg.num_layers):
        src = names["layer"].format(i=i)
        out.update((f"layers.{i}.{ours}", [f"{src}{n}.weight" for n in _sources(names, ours)])
                   for ours in _LINEARS)
    return out


def gpt_row_orders(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Linears whose stored rows (joined, where several) are reordered -> that order (the
    rows of the stored weight, in ours): GPT-NeoX's head-by-head QKV; GPT-J's q and k, each
    head's rotary columns evens first then odds (interleaved pairs -> rotate-half pairs)."""
    if cfg.architecture == "GPTNeoXForCausalLM":
        rows = _neox_qkv(torch.arange(3 * cfg.num_heads * cfg.head_dim), cfg.num_heads)
    elif cfg.architecture == "GPTJForCausalLM":
        d, r = cfg.head_dim, cfg.rotary_dim
        head = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])
        heads = cfg.num_heads + cfg.num_kv_heads                  # q's then k's; v as stored
        rows = torch.cat([(head + h * d) for h in range(heads)] +
                         [torch.arange(heads * d, (heads + cfg.num_kv_heads) * d)])
    else:
        return {}
    return {f"layers.{i}.attn.qkv": rows for i in range(cfg.num_layers)}


def _neox_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head][q, k, v][d] (weight [3 H, hidden] or bias [3 H]) -> [q, k, v][head][d]."""
    return w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
