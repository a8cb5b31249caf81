"""Small decode steps through every decoder layer in one native call (csrc/decode_stack.cpp).

At batch 1 the layers' kernels take ~5 ms of a ~7 ms step; the rest is Python and ctypes
going back and forth ~300 times. The native stack runs the same kernels in the same order
as LlamaForCausalLM.forward, so its hidden states are bit-identical to the per-op path
(tests/actors/test_fused_decode.py); it only removes the round trips.

It applies to plain Llama-shaped layers (no QKV bias, q/k norms, sandwich norms, GELU or
soft-capping; sliding windows are fine) whose four linears all hold quantized weights, on
the native CPU kernels without tensor parallelism, and to steps that decode only, with at
most the linears' `quantized_max_tokens` tokens. Everything else takes the per-op path.
"""
from __future__ import annotations

import torch

from pagewire.kernels.attention import AttentionBatch

_TYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}


class FusedDecode:
    """Per-layer pointers (weights, KV caches, rope tables) laid out once; valid while the
    model (which holds this) and `kv_caches` (referenced here) live."""

    def __init__(self, model, kv_caches: list[torch.Tensor], fn):
        cfg, layers = model.cfg, model.layers
        self.kv_caches, self._fn, self.hidden = kv_caches, fn, cfg.hidden_size
        self.max_tokens = min(l.attn.qkv.quantized_max_tokens for l in layers)
        self.dtype = kv_caches[0].dtype
        rows = [_layer_row(layer, kv_caches[i], model.rope_tables[cfg.layer_rope[i]])
                for i, layer in enumerate(layers)]
        self.layers = torch.tensor(rows, dtype=torch.int64)              # [L, fields]
        attn = layers[0].attn
        self.shape = torch.tensor([cfg.hidden_size, attn.num_heads, attn.num_kv_heads,
                                   attn.head_dim, layers[0].mlp.down.in_features,
                                   kv_caches[0].shape[2]], dtype=torch.int64)
        self.scale, self.eps = attn.scale, cfg.rms_norm_eps

    @classmethod
    def build(cls, model, kv_caches: list[torch.Tensor]) -> "FusedDecode | None":
        """The fused path for this model and these caches, or None where it does not apply."""
        lib = model.ops.lib.cdll if model.ops.name == "cpu" else None
        dtype = kv_caches[0].dtype if kv_caches else None
        if lib is None or model.tp.size != 1 or dtype not in _TYPES \
                or not all(_plain(layer, dtype) for layer in model.layers) \
                or lib.pw_decode_stack_fields() != len(_FIELDS) \
                or not all(c.is_contiguous() for c in kv_caches):
            return None
        return cls(model, kv_caches, getattr(lib, f"pw_decode_stack_{_TYPES[dtype]}"))

    def serves(self, tokens: int, batch: AttentionBatch, kv_caches) -> bool:
        return (tokens <= self.max_tokens and not batch.prefills and kv_caches is self.kv_caches
                and batch.num_decode_tokens == tokens)

    def run(self, x: torch.Tensor, positions: torch.Tensor,
            batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] embeddings (overwritten) -> (last layer's output, residual stream)."""
        tables, lens, slots = batch.decode_block_tables, batch.decode_context_lens, \
            batch.slot_mapping
        t = x.shape[0]
        for name, v in (("positions", positions), ("slots", slots), ("lens", lens),
                        ("tables", tables)):
            if v.dtype != torch.int64 or not v.is_contiguous() or v.shape[0] != t:
                raise ValueError(f"fused decode: {name} must be contiguous int64 with {t} rows")
        if x.dtype != self.dtype or not x.is_contiguous() or x.shape[1] != self.hidden:
            raise ValueError(f"fused decode: x must be contiguous {self.dtype} [T, H]")
        residual = torch.empty_like(x)
        self._fn(x.data_ptr(), residual.data_ptr(), self.layers.data_ptr(), len(self.layers),
                 self.shape.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                 tables.data_ptr(), lens.data_ptr(), t, tables.shape[1], self.eps, self.scale)
        return x, residual


_FIELDS = ("input_norm", "post_norm", "qkv", "qkv_type", "o_proj", "o_proj_type", "gate_up",
           "gate_up_type", "down", "down_type", "k_cache", "v_cache", "window", "rope_table")


def _plain(layer, dtype: torch.dtype) -> bool:
    attn, mlp = layer.attn, layer.mlp
    linears = (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down)
    norms = (layer.input_norm.weight, layer.post_norm.weight)
    return (all(l.quantized is not None and l.bias is None for l in linears)
            and all(w.dtype == dtype and w.is_contiguous() for w in norms)
            and len({l.quantized_max_tokens for l in linears}) == 1
            and attn.q_norm is None and layer.post_attn_norm is None and not mlp.gelu
            and attn.variant.softcap is None)


def _layer_row(layer, kv_cache: torch.Tensor, rope_table: torch.Tensor) -> list[int]:
    attn, mlp = layer.attn, layer.mlp
    if rope_table.dtype != torch.float32 or not rope_table.is_contiguous():
        raise ValueError("fused decode: rope tables must be contiguous float32")
    row = [layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr()]
    for linear in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down):
        row += [linear.quantized.tiles.data_ptr(), linear.quantized.ggml_type]
    row += [kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), attn.variant.window or 0,
            rope_table.data_ptr()]
    return row
