"""Hugging Face tensor names -> LlamaForCausalLM's state dict: q/k/v and gate/up fused (Phi3
ships them fused already), norms renamed by role, Gemma's norm weights made plain (its
RMSNorm multiplies by 1 + weight)."""
from __future__ import annotations

import torch

from .gpt_oss_weights import gpt_oss_expert_blocks, gpt_oss_layer, gpt_oss_mlp_sources
from .gpt_weights import (fuse_gpt_weights, gpt_embedding_source, gpt_linear_sources,
                          gpt_row_orders)
from .model_config import LlamaConfig

# Hugging Face layer norm name -> ours, per family. Llama's post_attention_layernorm is the
# norm before the MLP; Gemma's normalizes the attention output (its pre-MLP norm is
# pre_feedforward_layernorm).
_NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_norm"}
_SANDWICH_NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm",
                   "pre_feedforward_layernorm": "post_norm",
                   "post_feedforward_layernorm": "post_mlp_norm"}


def fuse_weights(weights: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...) -> this module's
    state dict. Tensors pass through unchanged where no fusing is needed. A Linear whose
    sources are absent (the loader skips those that keep only their blocks) gets no entry."""
    if not cfg.gated_mlp:                                    # the GPT family's names
        return fuse_gpt_weights(weights, cfg)
    norm = _gemma_norm if cfg.architecture.startswith("Gemma") else (lambda w: w)
    out = {"norm.weight": norm(weights["model.norm.weight"])}
    _put(out, "embed.weight", weights.get("model.embed_tokens.weight"))    # absent: blocks
    tied = cfg.tie_word_embeddings
    lm_head = out.get("embed.weight") if tied else weights.get(_head_source(cfg))
    _put(out, "lm_head.weight", lm_head)
    names = _SANDWICH_NORMS if cfg.sandwich_norms else _NORMS
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        _attention(weights, src + "self_attn.", dst + "attn.", cfg, out)
        if src + "mlp.gate_up_proj.weight" in weights:                     # Phi3: fused
            out[dst + "mlp.gate_up.weight"] = weights[src + "mlp.gate_up_proj.weight"]
        if cfg.architecture == "GptOssForCausalLM":                        # stacked experts
            out.update(gpt_oss_layer(weights, cfg, i))
        for name, sources in mlp_sources(cfg, i).items():
            if f"{dst}{name}.weight" not in out:         # Phi3's gate_up: put above
                _put(out, f"{dst}{name}.weight", _joined(weights, sources))
        for theirs, ours in names.items():
            out[f"{dst}{ours}.weight"] = norm(weights[f"{src}{theirs}.weight"])
        if cfg.qk_norm:
            for p in "qk":
                out[f"{dst}attn.{p}_norm.weight"] = norm(weights[f"{src}self_attn.{p}_norm.weight"])
    return out


def linear_sources(cfg: LlamaConfig) -> dict[str, list[str]]:
    """Each Linear of the model -> the Hugging Face tensors fuse_weights concatenates (by
    rows) into its weight, for loaders that keep weights in their stored form."""
    if not cfg.gated_mlp:
        return gpt_linear_sources(cfg)
    out = {"lm_head": ["model.embed_tokens.weight" if cfg.tie_word_embeddings
                       else _head_source(cfg)]}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attn.qkv"] = [f"{src}self_attn.{p}_proj.weight" for p in "qkv"]
        out[dst + "attn.o_proj"] = [src + "self_attn.o_proj.weight"]
        out.update((dst + name, names) for name, names in mlp_sources(cfg, i).items())
    return out


def _head_source(cfg: LlamaConfig) -> str:
    """The LM head's tensor, or a classifier's score head in its place."""
    return "score.weight" if cfg.num_labels else "lm_head.weight"


def embedding_source(cfg: LlamaConfig) -> str:
    """The Hugging Face name of the token embedding (GGUF token_embd)."""
    return "model.embed_tokens.weight" if cfg.gated_mlp else gpt_embedding_source(cfg)


def linear_row_orders(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Linears whose stored rows fuse_weights reorders -> the order, for loaders keeping
    blocks as stored (GPT-NeoX's head-by-head QKV); other Linears keep their rows."""
    return gpt_row_orders(cfg)


def expert_blocks(stored: dict[str, tuple[int, torch.Tensor]], cfg: LlamaConfig,
                  held) -> dict[str, tuple[int, torch.Tensor]]:
    """Linears' stored blocks that the model's mapping cuts from stacks of experts' blocks
    (a quantized checkpoint's 3-D ones, popped from `stored`): {module name: (GGML type,
    rows)}, for the Linears in `held`. gpt-oss's only; other stacks are left."""
    if cfg.architecture != "GptOssForCausalLM":
        return {}
    return gpt_oss_expert_blocks(stored, cfg, held)


def mlp_sources(cfg: LlamaConfig, layer: int) -> dict[str, list[str]]:
    """Layer `layer`'s MLP Linears (names within the layer) -> the Hugging Face tensors each
    joins by rows: a dense MLP's gate_up and down, or a sparse one's router, each expert's
    (Mixtral calls gate, up and down w1, w3 and w2) and a shared expert with its gate."""
    src = f"model.layers.{layer}."
    if cfg.architecture == "GptOssForCausalLM":
        return gpt_oss_mlp_sources(layer, cfg)
    if not cfg.sparse_layers[layer]:
        return {"mlp.gate_up": [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"],
                "mlp.down": [src + "mlp.down_proj.weight"]}
    mixtral = cfg.architecture == "MixtralForCausalLM"
    moe = src + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {"mlp.router": [moe + "gate.weight"]}
    for e in range(cfg.num_experts):
        expert = f"{moe}experts.{e}."
        out[f"mlp.experts.{e}.gate_up"] = [f"{expert}{gate}.weight", f"{expert}{up}.weight"]
        out[f"mlp.experts.{e}.down"] = [f"{expert}{down}.weight"]
    if cfg.shared_expert_size:
        shared = moe + "shared_expert."
        out["mlp.shared.gate_up"] = [shared + "gate_proj.weight", shared + "up_proj.weight"]
        out["mlp.shared.down"] = [shared + "down_proj.weight"]
        out["mlp.shared_gate"] = [moe + "shared_expert_gate.weight"]
    return out


def _attention(weights, src: str, dst: str, cfg: LlamaConfig, out: dict) -> None:
    for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
        if src + f"qkv_proj.{kind}" in weights:                            # Phi3: fused
            out[dst + f"qkv.{kind}"] = weights[src + f"qkv_proj.{kind}"]
        else:
            _put(out, dst + f"qkv.{kind}", _joined(weights, [src + f"{p}_proj.{kind}" for p in "qkv"]))
    _put(out, dst + "o_proj.weight", weights.get(src + "o_proj.weight"))


def _joined(weights: dict, names: list[str]) -> torch.Tensor | None:
    """The named tensors concatenated by rows; None where any is absent."""
    parts = [weights.get(n) for n in names]
    return None if any(p is None for p in parts) else torch.cat(parts)


def _put(out: dict, name: str, tensor: torch.Tensor | None) -> None:
    if tensor is not None:
        out[name] = tensor


def _gemma_norm(w: torch.Tensor) -> torch.Tensor:
    return w.float() + 1.0
