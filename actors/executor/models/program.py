"""A decoder layer as a declared program: a short list of typed ops built once from the
config, which every path runs. The Python forward (DecoderLayer.forward) steps through it
calling the backend (`ops`); the fused native decode (fused_decode.py) encodes the same
program as opcodes that csrc/decode_stack.cpp interprets. An architecture's options change
the program, never the code that runs it, so adding an op means one implementation per
backend rather than a second decoder.

Each op reads the current value (the hidden states, then what the previous op made of them)
and leaves the next one; ADD_NORM also carries the residual stream. `arg` names the layer's
submodule an op uses (a norm, a linear, the attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewire.kernels.context_parallel import context_attention
from pagewire.kernels.kv_compress import compressed_attention
from pagewire.kernels.lora import adapted_linear
from pagewire.kernels.native_api import API
from pagewire.kernels.norm import rms_norm_split

# The opcodes (ADD_NORM, NORM, LINEAR, QK_NORM, QK_NORM_FLAT, ROPE, ATTEND, SILU_MUL, GELU_MUL,
# MOE, ALL_REDUCE, and the GPT family's ADD_LAYER_NORM, BRANCH_LAYER_NORM, JOIN, GELU,
# GELU_TANH),
# declared with what each does and their values in kernels/csrc/pagewire_api.h (PwOp), which
# the native interpreter (csrc/decode_stack.cpp) reads too.
Op = API.int_enum("PwOp", "Op", __name__)


@dataclass(frozen=True)
class Step:
    op: Op
    arg: str = ""    # the layer submodule it uses, as a dotted path ("attn.qkv")


def layer_program(cfg, tp_size: int = 1, layer: int = 0) -> tuple[Step, ...]:
    """Layer `layer`'s ops for `cfg` (models/model_config.py LlamaConfig): pre-norm attention
    then MLP (a mixture of experts where the layer is sparse), each output summed over ranks
    (only with tensor parallelism: the sum of one rank is x)."""
    reduce = (Step(Op.ALL_REDUCE),) if tp_size > 1 else ()
    add_norm = Op.ADD_LAYER_NORM if cfg.layer_norm else Op.ADD_NORM
    steps = [Step(add_norm, "input_norm"), Step(Op.LINEAR, "attn.qkv")]
    if cfg.qk_norm:
        steps.append(Step(Op.QK_NORM_FLAT if cfg.qk_norm_flat else Op.QK_NORM, "attn"))
    steps += [Step(Op.ROPE, "attn"), Step(Op.ATTEND, "attn"), Step(Op.LINEAR, "attn.o_proj")]
    if cfg.parallel_residual:        # the MLP reads the residual the attention read
        return (*steps, Step(Op.BRANCH_LAYER_NORM, "post_norm"), *_mlp(cfg, layer),
                Step(Op.JOIN), *reduce)
    steps += reduce
    if cfg.sandwich_norms:
        steps.append(Step(Op.NORM, "post_attn_norm"))
    steps += [Step(add_norm, "post_norm"), *_mlp(cfg, layer), *reduce]
    if cfg.sandwich_norms:
        steps.append(Step(Op.NORM, "post_mlp_norm"))
    return tuple(steps)


def _mlp(cfg, layer: int) -> list[Step]:
    """A mixture of experts, a gated MLP or the GPT family's plain one."""
    if cfg.sparse_layers[layer]:
        return [Step(Op.MOE, "mlp")]
    if not cfg.gated_mlp:
        act = Op.GELU if cfg.activation == "gelu" else Op.GELU_TANH
        return [Step(Op.LINEAR, "mlp.up"), Step(act), Step(Op.LINEAR, "mlp.down")]
    act = Op.GELU_MUL if cfg.activation == "gelu_tanh" else Op.SILU_MUL
    return [Step(Op.LINEAR, "mlp.gate_up"), Step(act), Step(Op.LINEAR, "mlp.down")]


class State:
    """What flows between ops: the current value, the residual stream, and the step's inputs
    (and, in a parallel-residual layer, the attention's output set aside)."""
    __slots__ = ("x", "residual", "rope", "kv_cache", "batch", "lora", "branch")

    def __init__(self, x, residual, rope, kv_cache, batch, lora=None):
        self.x, self.residual, self.rope = x, residual, rope
        self.kv_cache, self.batch = kv_cache, batch
        self.lora = lora            # executor/lora.py LoraBatch of the step's adapters, or None
        self.branch = None


def _add_norm(ops, norm, s: State) -> None:
    s.x, s.residual = ops.add_rms_norm(s.x, s.residual, norm.weight, norm.eps)


def _add_layer_norm(ops, norm, s: State) -> None:
    s.x, s.residual = ops.add_layer_norm(s.x, s.residual, norm.weight, norm.bias, norm.eps)


def _branch_layer_norm(ops, norm, s: State) -> None:
    s.branch = s.x
    s.x = ops.add_layer_norm(s.residual, None, norm.weight, norm.bias, norm.eps)[0]


def _join(ops, _, s: State) -> None:
    s.x = s.x + s.branch            # HF's order: mlp + attn, then (next norm) + residual


def _gelu(ops, _, s: State) -> None:
    s.x = ops.gelu(s.x, approximate="none")


def _gelu_tanh(ops, _, s: State) -> None:
    s.x = ops.gelu(s.x, approximate="tanh")


def _norm(ops, norm, s: State) -> None:
    s.x = ops.add_rms_norm(s.x, None, norm.weight, norm.eps)[0]


def _linear(ops, linear, s: State) -> None:
    s.x = adapted_linear(ops, linear, s.x, s.lora)   # float32 from a row-parallel linear


def _qk_norm(ops, attn, s: State) -> None:
    ops.rms_norm_heads_(s.x, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                        attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)


def _qk_norm_flat(ops, attn, s: State) -> None:
    if attn.tp.size > 1:           # each rank holds some heads: the sums of squares all-reduced
        q, k = s.x[:, :attn.q_size], s.x[:, attn.q_size:attn.q_size + attn.kv_size]
        for part, norm, width in ((q, attn.q_norm, attn.q_width), (k, attn.k_norm, attn.k_width)):
            part.copy_(rms_norm_split(part, norm.weight, norm.eps, width, attn.tp.all_reduce))
        return
    ops.rms_norm_flat_qk_(s.x, attn.q_size, attn.kv_size, attn.q_norm.weight,
                          attn.k_norm.weight, attn.q_norm.eps)


def _moe(ops, sparse, s: State) -> None:
    s.x = ops.moe(sparse, s.x, s.lora if s.lora is not None and s.lora.adapts_experts else None)


def _rope(ops, attn, s: State) -> None:
    if attn.rotary_dim == attn.head_dim:
        s.x = ops.split_qkv_rope(s.x, attn.num_heads, attn.num_kv_heads, attn.head_dim, *s.rope)
    else:                    # the GPT family: the first rotary_dim columns of a head, or none
        s.x = ops.split_qkv_partial_rope(s.x, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                         attn.rotary_dim, *s.rope)


def _attend(ops, attn, s: State) -> None:
    q, k, v = s.x                                     # [T, Hq, D], [T, Hkv, D] x 2
    if s.batch.heads is not None:                     # KV-Compress: rows per KV head
        o = compressed_attention(ops, attn.layer, q, k, v, s.kv_cache, s.batch, attn.scale,
                                 attn.variant)
    elif attn.cp is None:
        o = ops.attention(q, k, v, s.kv_cache, s.batch, attn.scale, attn.variant)
    else:                                             # its KV head's tokens split over ranks
        o = context_attention(ops, attn.cp, q, k, v, s.kv_cache, s.batch, attn.scale,
                              attn.variant)
    s.x = o.reshape(q.shape[0], attn.q_size)          # [T, Hq D]


def _silu_mul(ops, _, s: State) -> None:
    s.x = ops.silu_and_mul(s.x)


def _gelu_mul(ops, _, s: State) -> None:
    s.x = ops.gelu_tanh_and_mul(s.x)


def _all_reduce(ops, tp, s: State) -> None:
    s.x = tp.all_reduce(s.x).to(s.residual.dtype)       # float32 partials, rounded once


RUN = {Op.ADD_LAYER_NORM: _add_layer_norm, Op.BRANCH_LAYER_NORM: _branch_layer_norm,
       Op.JOIN: _join, Op.GELU: _gelu, Op.GELU_TANH: _gelu_tanh, Op.ADD_NORM: _add_norm, Op.NORM: _norm, Op.LINEAR: _linear, Op.QK_NORM: _qk_norm,
       Op.QK_NORM_FLAT: _qk_norm_flat, Op.ROPE: _rope, Op.ATTEND: _attend,
       Op.SILU_MUL: _silu_mul, Op.GELU_MUL: _gelu_mul, Op.MOE: _moe, Op.ALL_REDUCE: _all_reduce}


def bind(layer, program: tuple[Step, ...]) -> list:
    """(function, operand) pairs for `layer`, resolved once: the per-op path runs every step of
    every layer each forward, so the lookups are not repeated there."""
    return [(RUN[step.op], layer.get_submodule(step.arg) if step.arg else
             (layer.attn.tp if step.op == Op.ALL_REDUCE else None)) for step in program]


def run(bound: list, ops, s: State) -> tuple[torch.Tensor, torch.Tensor]:
    for fn, operand in bound:
        fn(ops, operand, s)
    return s.x, s.residual
