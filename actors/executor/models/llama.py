"""The Llama family's forward pass over a flattened batch (no padding), reading and writing the
paged KV cache. Weights are fused at load: one QKV projection and one gate/up projection."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagewire.kernels.attention import AttentionBatch
from pagewire.kernels.linear import Linear
from pagewire.kernels.ops import TorchOps
from pagewire.kernels.rotary import rope_cos_sin

from ..parallel import TensorParallel, split_range


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta") or cfg.get("rope_theta", 10000.0),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False))

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output: bool) -> "LlamaConfig":
        arch = meta["general.architecture"]
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        return cls(
            vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden, intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=int(meta[f"{arch}.block_count"]), num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position=int(meta[f"{arch}.context_length"]),
            tie_word_embeddings=not has_output)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, ops, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism): QKV column-parallel,
    o_proj row-parallel, summed over ranks."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel):
        super().__init__()
        share = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = share.num_q, share.num_kv, cfg.head_dim
        self.q_size = share.num_q * cfg.head_dim
        self.kv_size = share.num_kv * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, ops, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = ops.split_qkv_rope(self.qkv.forward(x), self.num_heads, self.num_kv_heads,
                                     self.head_dim, *rope)   # [T, Hq, D], [T, Hkv, D] x 2
        o = ops.attention(q, k, v, kv_cache, batch, self.scale)                # [T, Hq, D]
        return self.tp.all_reduce(self.o_proj.forward(o.reshape(t, self.q_size)))   # [T, H]


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel (a slice of the intermediate rows per rank)."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel):
        super().__init__()
        start, end = split_range(cfg.intermediate_size, tp.size, tp.rank)
        self.tp = tp
        self.gate_up = Linear(cfg.hidden_size, 2 * (end - start), bias=False)
        self.down = Linear(end - start, cfg.hidden_size, bias=False)

    def forward(self, ops, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down.forward(ops.silu_and_mul(self.gate_up.forward(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, tp)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, ops, x, residual, rope, kv_cache, batch):
        x, residual = self.input_norm.forward(ops, x, residual)
        x = self.attn.forward(ops, x, rope, kv_cache, batch)
        x, residual = self.post_norm.forward(ops, x, residual)
        return self.mlp.forward(ops, x), residual


# The forward passes call submodules' .forward directly: nn.Module.__call__ (hooks machinery)
# costs ~3 us a call, ~0.8 ms of a 12 ms single-stream decode step.


class LlamaForCausalLM(nn.Module):
    config_class = LlamaConfig

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp or TensorParallel()
        v0, v1 = self.tp.vocab(cfg.vocab_size)                   # this rank's vocabulary rows
        self.embed = nn.Embedding(v1 - v0, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp) for _ in range(cfg.num_layers))
        self.num_kv_heads = self.layers[0].attn.num_kv_heads     # this rank's, for its KV cache
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, v1 - v0, bias=False)   # tied: shares embed's weight
        self.ops = TorchOps()     # the kernel set; the runner picks one for the device
        self.register_buffer("cos_sin", None, persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)build the non-weight buffers; the loader calls it after filling a model that was
        built on the meta device."""
        cfg = self.cfg
        self.cos_sin = rope_cos_sin(cfg.head_dim, cfg.max_position, cfg.rope_theta)  # [P, D]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], batch: AttentionBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H]."""
        x = self.tp.embed(self.embed.weight, input_ids, self.cfg.vocab_size)   # [T, H]
        rope = (self.cos_sin, positions)                           # [P, D] table, [T]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer.forward(self.ops, x, residual, rope, kv_cache, batch)
        x, _ = self.norm.forward(self.ops, x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, H] -> float32 logits [S, V] (every rank's vocabulary rows)."""
        return self.tp.gather_vocab(self.lm_head.forward(hidden).float(), self.cfg.vocab_size)

    @staticmethod
    def fuse_weights(weights: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
        """Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...) -> this module's
        state dict, with q/k/v and gate/up concatenated."""
        out = {"embed.weight": weights["model.embed_tokens.weight"],
               "norm.weight": weights["model.norm.weight"]}
        out["lm_head.weight"] = out["embed.weight"] if cfg.tie_word_embeddings \
            else weights["lm_head.weight"]
        for i in range(cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
                out[dst + f"attn.qkv.{kind}"] = torch.cat(
                    [weights[src + f"self_attn.{p}_proj.{kind}"] for p in "qkv"])
            out[dst + "attn.o_proj.weight"] = weights[src + "self_attn.o_proj.weight"]
            out[dst + "mlp.gate_up.weight"] = torch.cat(
                [weights[src + "mlp.gate_proj.weight"], weights[src + "mlp.up_proj.weight"]])
            out[dst + "mlp.down.weight"] = weights[src + "mlp.down_proj.weight"]
            out[dst + "input_norm.weight"] = weights[src + "input_layernorm.weight"]
            out[dst + "post_norm.weight"] = weights[src + "post_attention_layernorm.weight"]
        return out
