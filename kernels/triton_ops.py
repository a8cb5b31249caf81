"""The Triton kernel set: TorchOps' methods, each one Triton launch (attention: the cache
write, then one decode and one varlen prefill launch). Runs on CUDA; on CPU only under the
Triton interpreter (TRITON_INTERPRET=1, as the tests run it)."""
from __future__ import annotations

from dataclasses import replace

from .activation import triton_silu_and_mul
from .attention import PLAIN
from .attention_triton import (triton_decode_attention, triton_decode_lse,
                               triton_paged_attention)
from .cache import triton_write_kv
from .cascade import CUDA_THRESHOLDS
from .encoder_attention_triton import triton_encoder_attention
from .lora import triton_lora_delta
from .moe_triton import stacked_experts, triton_moe_block
from .norm import triton_add_rms_norm
from .ops import TorchOps
from .rotary import triton_rope_table_


class TritonOps(TorchOps):
    name = backend = "triton"
    cascade_thresholds = CUDA_THRESHOLDS

    def __init__(self, device=None):
        super().__init__(device)
        self.capabilities = replace(self.capabilities, lora_in_graphs=True)

    def add_rms_norm(self, x, residual, weight, eps):
        """As TorchOps.add_rms_norm; residual (when given) is updated in place."""
        return triton_add_rms_norm(x, residual, weight, eps)

    def split_qkv_rope(self, qkv, num_heads, num_kv_heads, head_dim, table, positions):
        """Rotates q and k in place inside qkv (one launch, the table gather fused), then
        returns views: q [T, Hq, D], k, v [T, Hkv, D]."""
        t = qkv.shape[0]
        heads = qkv.view(t, -1, head_dim)                   # [T, Hq + 2 Hkv, D]
        triton_rope_table_(heads[:, :num_heads + num_kv_heads], table, positions)
        q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        return q, k, v

    def moe(self, sparse, x, lora=None):
        """kernels/moe_triton.py's fused kernels on CUDA where the block's experts are dense
        weights of x's dtype; else (quantized experts, CPU tensors, adapters of the experts)
        torch's grouping."""
        # gpt-oss's clamped SwiGLU and adapters of the experts: torch's grouping
        fused = x.is_cuda and sparse.activation[0] == "silu" and lora is None
        experts = stacked_experts(sparse) if fused else None
        if experts is None or experts.w13.dtype != x.dtype:
            return super().moe(sparse, x, lora)
        return triton_moe_block(self, sparse, x, experts)

    def moe_in_graphs(self, sparse, dtype):
        """The fused kernels read the routing on the device; torch's grouping (the other
        blocks) does not."""
        experts = stacked_experts(sparse) if sparse.activation[0] == "silu" else None
        return experts is not None and experts.w13.is_cuda and experts.w13.dtype == dtype

    def silu_and_mul(self, gate_up):
        return triton_silu_and_mul(gate_up)

    def lora_delta(self, y, x, lora, slot):
        triton_lora_delta(y, x, lora.adapter_of_row, lora.dense(slot))

    def write_kv(self, kv_cache, k, v, slots):
        triton_write_kv(kv_cache, k, v, slots)

    def decode(self, q, kv_cache, tables, lens, scale, variant=PLAIN):
        if not variant.plain:
            return TorchOps.decode(self, q, kv_cache, tables, lens, scale, variant)
        return triton_decode_attention(q, kv_cache, tables, lens, scale)

    def decode_lse(self, q, kv_cache, tables, lens, scale, variant=PLAIN):
        if not variant.plain:
            return TorchOps.decode_lse(self, q, kv_cache, tables, lens, scale, variant)
        return triton_decode_lse(q, kv_cache, tables, lens, scale)

    def encoder_attention(self, q, k, v, seq_lens, scale, bias=None, window=None):
        # MPNet's position bias and ModernBERT's local windows: torch kernels for now
        if bias is not None or window is not None:
            return TorchOps.encoder_attention(self, q, k, v, seq_lens, scale, bias, window)
        return triton_encoder_attention(q, k, v, seq_lens, scale)

    def attention(self, q, k, v, kv_cache, batch, scale, variant=PLAIN):
        # sliding windows, soft-capping and images seen whole (Gemma 3's prefills): torch
        # kernels for now
        if not variant.plain or batch.beyond_causal:
            return TorchOps.attention(self, q, k, v, kv_cache, batch, scale, variant)
        return triton_paged_attention(q, k, v, kv_cache, batch, scale)
