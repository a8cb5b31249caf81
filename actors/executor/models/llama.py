"""The decoder's forward pass over a flattened batch (no padding), reading and writing the
paged KV cache: the Llama family, the mixtures of experts (moe.py) and the GPT family
(LayerNorms, plain MLPs, parallel residuals) as options of one decoder. Weights are fused at
load (weights.py): one QKV projection and one gate/up projection. The Llama family's
cousins are options of it too (model_config.py): QKV biases (Qwen2),
q/k norms (Qwen3, Gemma3), sliding windows (Mistral, Phi3, Gemma), sandwich norms, GELU,
scaled embeddings and soft-capping (Gemma2/3), per-layer rope bases (Gemma3). A layer's ops
are the program program.py declares from those options; the native fused decode runs the same
program (fused_decode.py)."""
from __future__ import annotations

import torch
from torch import nn

from pagewire.kernels.attention import AttentionBatch, Variant
from pagewire.kernels.linear import Linear
from pagewire.kernels.ops import TorchOps
from pagewire.kernels.rotary import rope_cos_sin, rope_inv_freq

from ..parallel import TensorParallel, split_range
from . import program
from .lora_slots import lora_slot
from .model_config import LlamaConfig
from .moe import SparseMoE
from .weights import expert_blocks, fuse_weights, linear_row_orders, linear_sources

__all__ = ["LlamaConfig", "LlamaForCausalLM"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, ops, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """The GPT family's norm: mean and variance, a weight and a bias."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, ops, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


def norm_class(cfg: LlamaConfig) -> type[nn.Module]:
    return LayerNorm if cfg.layer_norm else RMSNorm



class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism): QKV column-parallel,
    o_proj row-parallel, summed over ranks. Its weights and sizes; the layer's program runs it.
    `cp`: the ranks its KV head's tokens are split over (context parallelism), or None."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, layer: int, cp=None):
        super().__init__()
        self.cp = cp
        share = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = share.num_q, share.num_kv, cfg.head_dim
        self.q_size = share.num_q * cfg.head_dim
        self.kv_size = share.num_kv * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                          lora_slot=lora_slot(layer, "attn.qkv"))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias,
                             float_partial=tp.size > 1, lora_slot=lora_slot(layer, "attn.o_proj"))
        if cfg.qk_norm_flat and cfg.num_kv_heads % tp.size:
            raise ValueError(f"{cfg.architecture}: its k norm spans every key head, which "
                             f"{tp.size} ranks cannot split without repeating one")
        # the q/k norms' whole widths (OLMoE's span every head, a rank holding some of them)
        self.q_width, self.k_width = (cfg.num_heads * cfg.head_dim,
                                      cfg.num_kv_heads * cfg.head_dim)
        q_width, k_width = (self.q_size, self.kv_size) if cfg.qk_norm_flat else (cfg.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attn_scale
        # the columns of a head rope rotates (the GPT family: a part; GPT-2: none)
        self.rotary_dim = cfg.head_dim if cfg.rotary_dim == 0 else max(cfg.rotary_dim, 0)
        self.layer = layer
        # gpt-oss: a learned logit per q head in each softmax (Variant.sinks, float32)
        self.sinks = nn.Parameter(torch.zeros(share.num_q), requires_grad=False) \
            if cfg.attention_sinks else None
        self.variant = Variant(cfg.layer_windows[layer], cfg.attn_softcap)
        self.reset_variant()

    def reset_variant(self) -> None:
        """The variant again once the sinks are loaded or moved (the model's reset_buffers
        and _apply): it holds them as a float32 tensor of their own."""
        if self.sinks is not None:
            self.variant = Variant(self.variant.window, self.variant.softcap,
                                   self.sinks.detach().to(torch.float32, copy=True))


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel (a slice of the intermediate rows per rank).
    Its weights; the layer's program runs it."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, layer: int):
        super().__init__()
        start, end = split_range(cfg.intermediate_size, tp.size, tp.rank)
        self.tp = tp
        if cfg.gated_mlp:
            self.gate_up = Linear(cfg.hidden_size, 2 * (end - start), bias=False,
                                  lora_slot=lora_slot(layer, "mlp.gate_up"))
        else:           # the GPT family's: act(up x + b); up takes gate_up's LoRA slot
            self.up = Linear(cfg.hidden_size, end - start, bias=cfg.mlp_bias,
                             lora_slot=lora_slot(layer, "mlp.gate_up"))
        self.down = Linear(end - start, cfg.hidden_size,
                           bias=not cfg.gated_mlp and cfg.mlp_bias,
                           float_partial=tp.size > 1, lora_slot=lora_slot(layer, "mlp.down"))


class DecoderLayer(nn.Module):
    """Pre-norm residual block, its ops declared in program.py. With sandwich norms (Gemma) the
    attention and MLP outputs are normed too, before they join the residual stream."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, layer: int, cp=None):
        super().__init__()
        norm = norm_class(cfg)
        self.input_norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, tp, layer, cp)
        self.post_norm = norm(cfg.hidden_size, cfg.rms_norm_eps)           # before the MLP
        self.mlp = SparseMoE(cfg, tp, layer) if cfg.sparse_layers[layer] \
            else MLP(cfg, tp, layer)
        self.post_attn_norm = self.post_mlp_norm = None
        if cfg.sandwich_norms:
            self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.program = program.layer_program(cfg, tp.size, layer)   # what runs, on every path
        self._bound = program.bind(self, self.program)

    def forward(self, ops, x, residual, rope, kv_cache, batch, lora=None):
        """The layer's program (program.py), op by op through the backend."""
        return program.run(self._bound, ops,
                           program.State(x, residual, rope, kv_cache, batch, lora))


# The forward passes call submodules' .forward directly: nn.Module.__call__ (hooks machinery)
# costs ~3 us a call, ~0.8 ms of a 12 ms single-stream decode step.


class LlamaForCausalLM(nn.Module):
    config_class = LlamaConfig

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel | None = None, ops=None, cp=None):
        """ops: the backend's kernel set (kernels/ops.py; None: the torch reference), which
        every op of the forward calls; cp: the context-parallel group (parallel.py), or None."""
        super().__init__()
        self.cfg, self.tp = cfg, tp or TensorParallel()
        v0, v1 = self.tp.vocab(cfg.vocab_size)                   # this rank's vocabulary rows
        self.embed = nn.Embedding(v1 - v0, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp, i, cp)
                                    for i in range(cfg.num_layers))
        self.num_kv_heads = self.layers[0].attn.num_kv_heads     # this rank's, for its KV cache
        self.norm = norm_class(cfg)(cfg.hidden_size, cfg.rms_norm_eps)
        # GPT-2: learned absolute positions added to the embeddings
        self.pos_embed = nn.Embedding(cfg.learned_positions, cfg.hidden_size) \
            if cfg.learned_positions else None
        # tied: shares embed's weight; GPT-J's and Phi-2's have a bias; a classifier's score
        # head in its place, one row per label (tensor parallelism refused: model_info)
        self.lm_head = Linear(cfg.hidden_size, cfg.num_labels or v1 - v0, bias=cfg.lm_head_bias)
        self.ops = ops if ops is not None else TorchOps()
        self._fused = None        # fused_decode.py's program, where the backend built one
        self.register_buffer("cos_sin", None, persistent=False)
        self.rope_tables: list[torch.Tensor] = []
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)build the non-weight buffers; the loader calls it after filling a model that was
        built on the meta device. One (cos | sin) table per rope base, scaled as configured."""
        cfg = self.cfg
        self.rope_tables = []
        rotary = cfg.rotary_dim if cfg.rotary_dim > 0 else cfg.head_dim     # rope's columns
        for i, (theta, scaling) in enumerate(cfg.rope_tables):
            inv_freq, factor = rope_inv_freq(rotary, theta, scaling, cfg.max_position,
                                             seq_len=cfg.rope_table_len)
            if i == 0 and cfg.rope_freq_divisors:
                inv_freq = inv_freq / torch.tensor(cfg.rope_freq_divisors, dtype=torch.float32)
            table = rope_cos_sin(rotary, cfg.rope_table_len, theta, inv_freq)  # [P, rotary]
            self.rope_tables.append(table * factor if factor != 1.0 else table)
        self.cos_sin = self.rope_tables[0]
        for layer in self.layers:
            layer.attn.reset_variant()
        # experts read, per layer (models/moe.py SparseMoE.reads): the step's report takes them
        self._count_expert_reads(torch.zeros(cfg.num_layers, dtype=torch.int64,
                                             device=self.cos_sin.device))

    def _count_expert_reads(self, counts: torch.Tensor) -> None:
        """counts [L] int64 on the model's device (a GPU's counts are added there, in the
        step's stream, and read once a step), each sparse layer's block counting into its row."""
        self.expert_reads = counts
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.reads = counts[i:i + 1]

    def take_expert_reads(self) -> int:
        """Experts read since the last call (each chosen expert once a layer and forward
        pass), and the count starts over."""
        total = int(self.expert_reads.sum())
        self.expert_reads.zero_()
        return total

    @property
    def fused_decode(self):
        """The fused decode program (fused_decode.py FusedDecode) small decode steps over its
        caches take, or None: the per-op path runs every step."""
        return self._fused

    def use_fused_decode(self, fused) -> None:
        """The backend's prepare gives the model its fused decode program once the KV caches
        it encodes exist (executor/backend.py); None turns the fused path off."""
        self._fused = fused

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)    # moves the cos_sin buffer (table 0); the others follow
        self.rope_tables = [self.cos_sin] + [fn(t) for t in self.rope_tables[1:]]
        for layer in self.layers:
            layer.attn.reset_variant()
        self._count_expert_reads(self.expert_reads.to(self.cos_sin.device))
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], batch: AttentionBatch,
                lora=None, images=None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H]. `lora`: the rows'
        adapters (executor/lora.py LoraBatch), or None. `images`: (rows [R], embeddings
        [R, H]) that replace those rows' token embeddings (a vision model's image tokens:
        vision_language.py), or None."""
        cfg = self.cfg
        x = self.tp.embed(self.embed, input_ids, cfg.vocab_size)          # [T, H]
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed.weight[positions]
        if images is not None:
            x = x.index_copy(0, images[0], images[1].to(x.dtype))
        fused = self._fused
        ropes = self.rope_inputs(positions, images)
        if fused is not None and ropes[0][1] is positions \
                and fused.serves(x.shape[0], batch, kv_caches):
            x, residual = fused.run(x, positions, batch, lora)  # the same kernels, one call
        else:
            residual = None
            for layer, kv_cache, which in zip(self.layers, kv_caches, cfg.layer_rope):
                x, residual = layer.forward(self.ops, x, residual, ropes[which], kv_cache, batch,
                                            lora)
        x, _ = self.norm.forward(self.ops, x, residual)
        return x

    def rope_inputs(self, positions: torch.Tensor, images=None) -> list:
        """(table [P, D], the rows' positions [T]) per rope table: what each layer's rope
        gathers. A model whose step brings its own table (M-RoPE: vision_language.py) gives
        other positions than `positions`, and so never takes the fused decode path."""
        return [(table, positions) for table in self.rope_tables]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, H] -> float32 logits [S, V] (every rank's vocabulary rows); a
        classifier's: its labels' [S, L]."""
        if self.cfg.num_labels:
            return self.ops.linear(self.lm_head, hidden).float()
        logits = self.tp.gather_vocab(self.ops.linear(self.lm_head, hidden).float(),
                                      self.cfg.vocab_size)
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    fuse_weights = staticmethod(fuse_weights)
    linear_sources = staticmethod(linear_sources)
    linear_row_orders = staticmethod(linear_row_orders)
    expert_blocks = staticmethod(expert_blocks)
