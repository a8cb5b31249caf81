"""The one dispatch point: which implementation of each kernel family a model runs.

    ops = select_ops(device, "auto")   # "torch" | "cpu" | "triton"
    ops.attention(q, k, v, kv_cache, batch, scale)

TorchOps is plain torch on any device: the reference every other implementation is tested
against. CpuOps swaps in the native AVX-512 kernels (kernels/native.py) where they exist;
TritonOps the Triton kernels, on CUDA. Every set has the same methods and contracts.
"""
from __future__ import annotations

import logging

import torch

from . import activation, attention, native, norm, rotary

log = logging.getLogger(__name__)


class TorchOps:
    name = "torch"

    def add_rms_norm(self, x, residual, weight, eps):
        return norm.add_rms_norm(x, residual, weight, eps)

    def split_qkv_rope(self, qkv, num_heads, num_kv_heads, head_dim, table, positions):
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D], q and k rotated."""
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        cos_sin = table[positions].to(qkv.dtype)                       # [T, D]
        return (rotary.apply_rope(q.view(t, num_heads, head_dim), cos_sin),
                rotary.apply_rope(k.view(t, num_kv_heads, head_dim), cos_sin),
                v.view(t, num_kv_heads, head_dim))

    def silu_and_mul(self, gate_up):
        return activation.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        return activation.gelu_tanh_and_mul(gate_up)

    def attention(self, q, k, v, kv_cache, batch, scale, variant=attention.PLAIN):
        """`variant`: a sliding window and/or soft-capping (attention.Variant): the torch
        kernels and the native CPU decode implement them; Triton falls back to these."""
        return attention.paged_attention(q, k, v, kv_cache, batch, scale, variant=variant)


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, lib):
        self.lib = lib

    def add_rms_norm(self, x, residual, weight, eps):
        return native.add_rms_norm(x, residual, weight, eps)

    def split_qkv_rope(self, qkv, num_heads, num_kv_heads, head_dim, table, positions):
        """Rotates q and k in place inside qkv, then returns views (no copies)."""
        native.rope_(qkv, num_heads + num_kv_heads, head_dim, table, positions)
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
                v.view(t, num_kv_heads, head_dim))

    def silu_and_mul(self, gate_up):
        return native.silu_and_mul(gate_up)

    def attention(self, q, k, v, kv_cache, batch, scale, variant=attention.PLAIN):
        return attention.paged_attention(q, k, v, kv_cache, batch, scale, write=self._write_kv,
                                         decode=self._decode, prefill=self._prefill,
                                         variant=variant)

    @staticmethod
    def _write_kv(cache, k, v, slots):
        native.write_kv(cache[0], cache[1], k, v, slots)

    @staticmethod
    def _prefill(q, cache, batch, scale, variant, out) -> bool:
        """bfloat16 prefills (plain or windowed) on the native kernel; the rest on torch."""
        if variant.softcap is not None or not native.prefill_attention_serves(q, cache[0]):
            return False
        chunks, tables = batch.packed_prefills
        native.prefill_attention(q, cache[0], cache[1], chunks, tables, scale, variant.window,
                                 out)
        return True

    @staticmethod
    def _decode(q, cache, tables, lens, scale, variant):
        return native.decode_attention(q, cache[0], cache[1], tables, lens, scale,
                                       variant.window, variant.softcap)


def select_ops(device: torch.device, name: str = "auto") -> TorchOps:
    """The kernel set for `device`: "auto" picks triton on CUDA, the native CPU kernels on CPU
    (falling back to torch when they cannot be built)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "torch":
        return TorchOps()
    if name == "cpu":
        lib = native.load()
        return CpuOps(lib) if lib is not None else TorchOps()
    if name == "triton":
        from .triton_ops import TritonOps
        return TritonOps()
    raise ValueError(f"unknown kernel set {name!r} (auto, torch, cpu, triton)")
