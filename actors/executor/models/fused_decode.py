"""Small decode steps through every decoder layer in one native call (csrc/decode_stack.cpp).

At batch 1 most of a step's time outside the kernels is Python and ctypes going back and
forth a few hundred times. The native interpreter runs each layer's declared program
(program.py), the same program the per-op path runs, calling for each op the kernel CpuOps
calls for it, in the same order: its hidden states are bit-identical to the per-op path
(tests/actors/test_fused_decode.py); it only removes the round trips.

Here each layer's program is encoded as int64 words: an opcode (program.Op's value), then
its operands (pointers as integers, sizes, floats as a double's bits). It applies where
every op of every layer encodes: the native library implements the op
(pw_decode_stack_arity) and this file knows its operands, which for linears means quantized
weights or BF16 tiles (with or without a bias), all serving the same number of tokens or
every step. Otherwise, and for tensor parallelism, other backends, steps with a prefill or
with more than the linears' `quantized_max_tokens` tokens, the per-op path runs.
"""
from __future__ import annotations

import struct
import sys

import torch

from pagewire.kernels import kv_quant
from pagewire.kernels.attention import AttentionBatch

from .program import Op

_TYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}


class FusedDecode:
    """Every layer's encoded program, laid out once; valid while the model (which holds this)
    and `kv_caches` (referenced here) live."""

    def __init__(self, program: list[int], kv_caches: list[torch.Tensor], hidden: int,
                 scratch: int, max_tokens: int, dtype: torch.dtype, fn, head_rows: bool):
        self.kv_caches, self._fn, self.hidden, self.scratch = kv_caches, fn, hidden, scratch
        self.max_tokens, self.dtype, self.head_rows = max_tokens, dtype, head_rows
        self.program = torch.tensor(program, dtype=torch.int64)

    @classmethod
    def build(cls, model, kv_caches: list[torch.Tensor],
              head_rows: bool = False) -> "FusedDecode | None":
        """The fused path for this model and these caches, or None where it does not apply.
        head_rows: the caches are KV-Compress's pool (kernels/kv_compress.py), every layer's."""
        caps = model.ops.capabilities
        dtype = model.embed.weight.dtype                   # the activations'
        if not caps.fused_decode or dtype not in _TYPES or \
                not all(c.is_contiguous() for c in kv_caches):
            return None
        lib = model.ops.lib.cdll
        enc = _Encoder(model, dtype, lib.pw_decode_stack_arity, head_rows, caps.block_kinds)
        for i, layer in enumerate(model.layers):
            if not enc.layer(layer, kv_caches[i], model.rope_tables[model.cfg.layer_rope[i]]):
                return None
        if len(enc.max_tokens) > 1:      # the per-op path would switch weights part-way
            return None
        max_tokens = enc.max_tokens.pop() if enc.max_tokens else sys.maxsize
        return cls(enc.words, kv_caches, model.cfg.hidden_size, enc.scratch, max_tokens, dtype,
                   getattr(lib, f"pw_decode_stack_{_TYPES[dtype]}"), head_rows)

    def serves(self, tokens: int, batch: AttentionBatch, kv_caches) -> bool:
        return (tokens <= self.max_tokens and not batch.prefills and kv_caches is self.kv_caches
                and batch.num_decode_tokens == tokens and batch.cascade is None
                and (batch.heads is not None) == self.head_rows
                and (batch.heads is None or not batch.heads.observed))

    def run(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
            lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] embeddings (overwritten) -> (last layer's output, residual stream).
        `lora`: the rows' adapters (executor/lora.py LoraBatch), or None."""
        tables, lens, slots = batch.decode_block_tables, batch.decode_context_lens, \
            batch.slot_mapping
        if self.head_rows:            # [L, T Hkv, W], [L, T Hkv] x 2: a layer's rows at [l]
            heads = batch.heads
            tables, lens, slots = heads.decode_tables, heads.decode_lens, heads.slots
        t = x.shape[0]
        for name, v in (("positions", positions), ("slots", slots), ("lens", lens),
                        ("tables", tables)):
            rows = v.shape[1] if self.head_rows and name != "positions" else v.shape[0]
            if v.dtype != torch.int64 or not v.is_contiguous() or rows % t:
                raise ValueError(f"fused decode: {name} must be contiguous int64 with rows for "
                                 f"{t} tokens")
        if x.dtype != self.dtype or not x.is_contiguous() or x.shape[1] != self.hidden:
            raise ValueError(f"fused decode: x must be contiguous {self.dtype} [T, H]")
        residual = torch.empty_like(x)
        self._fn(x.data_ptr(), residual.data_ptr(), self.program.data_ptr(), len(self.program),
                 self.hidden, self.scratch, positions.data_ptr(), slots.data_ptr(),
                 tables.data_ptr(), lens.data_ptr(), t, tables.shape[-1],
                 *(_NO_LORA if lora is None else (lora.adapter_of_row.data_ptr(),
                                                  lora.table.data_ptr(), lora.table.shape[1])))
        return x, residual


_NO_LORA = (None, None, 0)


def _real(value: float) -> int:
    """A float operand as int64 words carry it: the double's bits."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


class _Encoder:
    """Encodes layers' programs one op at a time; an op it cannot encode refuses the model."""

    def __init__(self, model, dtype: torch.dtype, arity, head_rows: bool, kinds: frozenset):
        self.model, self.dtype, self.arity, self.head_rows = model, dtype, arity, head_rows
        self.kinds = kinds          # the weight kinds the backend multiplies as stored
        self.words: list[int] = []
        self.scratch = model.cfg.hidden_size   # the widest value an op makes, a token
        self.max_tokens: set[int] = set()

    def layer(self, layer, kv_cache: torch.Tensor, rope_table: torch.Tensor) -> bool:
        self.kv_cache, self.rope_table = kv_cache, rope_table
        for step in layer.program:
            encode = _ENCODERS.get(step.op)
            operands = encode(self, layer.get_submodule(step.arg) if step.arg else None) \
                if encode is not None else None
            if operands is None or self.arity(int(step.op)) != len(operands):
                return False
            self.words += [int(step.op), *operands]
        return True

    def norm(self, norm) -> list[int] | None:
        """An RMSNorm's weight, or a LayerNorm's weight and bias; then eps."""
        params = [norm.weight] if getattr(norm, "bias", None) is None else [norm.weight,
                                                                             norm.bias]
        if any(p.dtype != self.dtype or not p.is_contiguous() for p in params):
            return None
        return [*(p.data_ptr() for p in params), _real(norm.eps)]

    def linear(self, linear) -> list[int] | None:
        q, bias = linear.quantized, linear.bias
        if q is None or any(s.kind not in self.kinds for s in q.segments) or \
                bias is not None and (bias.dtype != self.dtype or not bias.is_contiguous()):
            return None
        if linear.quantized_max_tokens != sys.maxsize:    # else no switch to another path
            self.max_tokens.add(linear.quantized_max_tokens)
        self.scratch = max(self.scratch, linear.out_features)
        return [q.table.data_ptr(), linear.out_features, linear.in_features,
                0 if bias is None else bias.data_ptr(), linear.lora_slot]

    def rope(self, attn) -> list[int] | None:
        table = self.rope_table
        if table.dtype != torch.float32 or not table.is_contiguous():
            return None
        return [table.data_ptr(), attn.num_heads + attn.num_kv_heads, attn.head_dim,
                attn.rotary_dim]

    def attend(self, attn) -> list[int] | None:
        cache = self.kv_cache          # [2, num_blocks, bs, Hkv, D (+ 4)]; head rows: Hkv 1
        # kv_quant's Kind of a quantized cache, or PLAIN: a cache of the activations' dtype.
        kind = kv_quant.KINDS.get(cache.dtype,
                                  kv_quant.PLAIN if cache.dtype == self.dtype else None)
        sinks = attn.variant.sinks                # float32 [Hq] (llama.Attention's own copy)
        if kind is None or sinks is not None and (self.head_rows or not sinks.is_contiguous()):
            return None                           # (KV-Compress's rows: no sinks)
        return [cache[0].data_ptr(), cache[1].data_ptr(), attn.num_heads, attn.num_kv_heads,
                attn.head_dim, cache.shape[2], attn.variant.window or 0, _real(attn.scale),
                _real(attn.variant.softcap or 0.0), kind, int(self.head_rows),
                0 if sinks is None else sinks.data_ptr()]


    def qk_norm(self, attn) -> list[int] | None:
        weights = self._qk_weights(attn)
        return weights and [*weights, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                            _real(attn.q_norm.eps)]

    def qk_norm_flat(self, attn) -> list[int] | None:
        weights = self._qk_weights(attn)
        return weights and [*weights, attn.q_size, attn.kv_size, _real(attn.q_norm.eps)]

    def _qk_weights(self, attn) -> list[int] | None:
        """The q and k norms' weights, where they are the activations' dtype."""
        q, k = attn.q_norm.weight, attn.k_norm.weight
        return [q.data_ptr(), k.data_ptr()] if q.dtype == k.dtype == self.dtype else None

    def moe(self, sparse) -> list[int] | None:
        native = sparse.native_spec              # kernels/moe.py NativeMoe, where it runs
        return None if native is None or native.dtype != self.dtype or native.partial else \
            [native.words.data_ptr()]            # (a rank's float partial: not a stack's op)


def _no_operands(enc, _) -> list[int]:
    return []


_ENCODERS = {Op.ADD_NORM: _Encoder.norm, Op.NORM: _Encoder.norm, Op.LINEAR: _Encoder.linear,
             Op.ROPE: _Encoder.rope, Op.ATTEND: _Encoder.attend,
             Op.SILU_MUL: _no_operands, Op.MOE: _Encoder.moe,
             Op.QK_NORM: _Encoder.qk_norm, Op.QK_NORM_FLAT: _Encoder.qk_norm_flat,
             Op.ADD_LAYER_NORM: _Encoder.norm, Op.BRANCH_LAYER_NORM: _Encoder.norm,
             Op.JOIN: _no_operands, Op.GELU: _no_operands, Op.GELU_TANH: _no_operands}
