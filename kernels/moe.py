"""Mixture-of-experts: routing in the models' own arithmetic, then each chosen expert run
once over the tokens that chose it.

route() is the one routing every backend uses: softmax of the router logits in float32 (the
Hugging Face models' arithmetic, which Mixtral, Qwen2/3-MoE and OLMoE share), the top k
(ties: the lower expert index first, a rule of ours: torch.topk, which transformers calls,
states none), and, where the model says so, the k weights rescaled to sum to one; gpt-oss's
the other way round: the top k of the logits (its router has a bias), then their softmax.

sparse_mlp() groups the step's (token, choice) pairs by expert: an expert no token chose is
never read (a decode step streams only its tokens' experts' weights), and an expert chosen
by many tokens multiplies them as one matrix (a prefill chunk's GEMM per expert). A token
may choose an expert once (topk picks distinct experts); several tokens choosing the same
expert are rows of its one matmul. Outputs are weighted and summed in float32, rounded once.
"""
from __future__ import annotations

import struct
import sys
from typing import NamedTuple

import torch

from .activation import swiglu_oai
from .lora import adapted_linear
from .native_api import API

# The words of a block's description for csrc/moe.cpp (pagewire_api.h PwMoe).
MoeWord = API.int_enum("PwMoe", "MoeWord", __name__)


def route(logits: torch.Tensor, top_k: int, normalize: bool,
          topk_then_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64). topk_then_softmax
    (gpt-oss): the k largest logits, then a softmax over those k alone (the same experts as
    softmax first; weights that sum to one)."""
    if topk_then_softmax:
        top, experts = torch.sort(logits.float(), dim=-1, descending=True, stable=True)
        return torch.softmax(top[:, :top_k], dim=-1), experts[:, :top_k]
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def by_expert(experts: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """experts [T, k] -> [(expert, its tokens [n], their choice slots [n])], by expert index;
    tokens ascending within an expert."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)            # (token, slot) pairs grouped by expert
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    k = experts.shape[1]
    groups, start = [], 0
    for e, n in zip(ids.tolist(), counts.tolist()):
        pairs = order[start:start + n]
        groups.append((e, pairs // k, pairs % k))
        start += n
    return groups


def sparse_mlp(ops, moe, x: torch.Tensor, lora=None) -> torch.Tensor:
    """x [T, H] -> [T, H]: the routed experts' weighted sum (plus the gated shared expert),
    through `ops` (the backend's linear and activation). `moe`: models/moe.py SparseMoE.
    float32 where moe.float_partial (a rank's partial sum), else x's dtype. The router's and
    the shared gate's products are float32 (the weights and x widened, summed unrounded).
    `lora`: the rows' LoRA adapters (executor/lora.py LoraBatch), whose deltas each expert's
    products add for its tokens, or None."""
    weights, experts = block_route(moe, x)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    groups = by_expert(experts)
    if moe.reads is not None:
        moe.reads += len(groups)
    for e, tokens, slots in groups:
        if str(e) not in moe.experts:                   # another rank's (expert parallel)
            continue
        y = _expert(ops, moe.experts[str(e)], x[tokens], moe.activation,
                    None if lora is None else lora.subset(tokens))
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
    add_shared(ops, moe, x, out, lora)
    return out if moe.float_partial else out.to(x.dtype)


def block_route(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """route() of the block's router product (float32, its bias added where it has one):
    (weights [T, k], experts [T, k])."""
    return route(_float_product(x, moe.router), moe.top_k, moe.normalize, moe.topk_then_softmax)


def add_shared(ops, moe, x: torch.Tensor, out: torch.Tensor, lora=None) -> None:
    """out [T, H] float32 += the gated shared expert's output (Qwen2-MoE), where it has one."""
    if moe.shared is not None:
        gate = torch.sigmoid(_float_product(x, moe.shared_gate))         # [T, 1]
        out += gate * _expert(ops, moe.shared, x, lora=lora).float()


def _float_product(x: torch.Tensor, linear) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias.float()
    return torch.nn.functional.linear(x.float(), linear.weight.float(), bias)


def _expert(ops, expert, x: torch.Tensor, activation=("silu",), lora=None) -> torch.Tensor:
    """One expert's gated MLP over its tokens x [n, H]: SiLU, or gpt-oss's clamped SwiGLU
    (activation ("swiglu_oai", alpha, limit)); `lora`: those tokens' adapters, or None."""
    gate_up = adapted_linear(ops, expert.gate_up, x, lora)
    if activation[0] == "swiglu_oai":
        act = swiglu_oai(gate_up, *activation[1:])
    else:
        act = ops.silu_and_mul(gate_up)
    return adapted_linear(ops, expert.down, act, lora)


class NativeMoe(NamedTuple):
    """A block as csrc/moe.cpp runs it: its PwMoe words (int64), for activations of `dtype`;
    `partial`: a tensor-parallel rank's share, whose output is a float32 partial.
    Valid while the block's weights stay where they are (the backend lays it out last)."""
    words: torch.Tensor
    dtype: torch.dtype
    partial: bool = False


def native_spec(moe, kinds: frozenset) -> NativeMoe | None:
    """`moe` (models/moe.py SparseMoE) for the native kernels, or None where they cannot run
    it: every expert's weights (the shared expert's too) tiles of `kinds` serving every step,
    in column order, biases (the routed experts' only) of the activations' dtype; SiLU or
    gpt-oss's clamped SwiGLU. A rank's share under -tp (moe.float_partial) gives a float32
    partial, its down products of float32 activations as a float partial Linear's."""
    dtype = moe.router.weight.dtype
    shared = [moe.shared] if moe.shared is not None else []
    routed = [linear for e in moe.experts.values() for linear in (e.gate_up, e.down)]
    if dtype not in (torch.bfloat16, torch.float32) \
            or moe.activation[0] not in ("silu", "swiglu_oai") \
            or not all(_tiled(linear, kinds, dtype) for linear in routed) \
            or not all(_tiled(linear, kinds, None)
                       for e in shared for linear in (e.gate_up, e.down)) \
            or not _biased(moe.router, dtype):
        return None
    per = MoeWord.EXPERT_WORDS
    words = [0] * (MoeWord.EXPERT_TABLES + per * moe.num_experts)
    words[MoeWord.EXPERTS], words[MoeWord.TOP_K] = moe.num_experts, moe.top_k
    words[MoeWord.NORMALIZE], words[MoeWord.HIDDEN] = int(moe.normalize), moe.router.in_features
    words[MoeWord.ROUTER] = _address(moe.router.weight)
    words[MoeWord.ROUTER_BIAS] = _bias_address(moe.router)
    words[MoeWord.TOPK_SOFTMAX] = int(moe.topk_then_softmax)
    if moe.activation[0] == "swiglu_oai":
        words[MoeWord.SWIGLU_OAI] = 1
        words[MoeWord.SWIGLU_ALPHA], words[MoeWord.SWIGLU_LIMIT] = map(_real, moe.activation[1:])
    words[MoeWord.READS] = 0 if moe.reads is None else moe.reads.data_ptr()
    for index, expert in moe.experts.items():
        at = MoeWord.EXPERT_TABLES + per * int(index)
        words[at:at + per] = expert.gate_up.quantized.table.data_ptr(), \
            expert.down.quantized.table.data_ptr(), _bias_address(expert.gate_up), \
            _bias_address(expert.down), expert.gate_up.lora_slot, expert.down.lora_slot
    words[MoeWord.SHARED_GATE_UP_SLOT] = words[MoeWord.SHARED_DOWN_SLOT] = -1
    words[MoeWord.INTER] = next(iter(moe.experts.values())).down.in_features
    if moe.shared is not None:
        words[MoeWord.SHARED_GATE_UP] = moe.shared.gate_up.quantized.table.data_ptr()
        words[MoeWord.SHARED_DOWN] = moe.shared.down.quantized.table.data_ptr()
        words[MoeWord.SHARED_GATE] = _address(moe.shared_gate.weight)
        words[MoeWord.SHARED_INTER] = moe.shared.down.in_features
        words[MoeWord.SHARED_GATE_UP_SLOT] = moe.shared.gate_up.lora_slot
        words[MoeWord.SHARED_DOWN_SLOT] = moe.shared.down.lora_slot
    return NativeMoe(torch.tensor(words, dtype=torch.int64), dtype, moe.float_partial)


def _tiled(linear, kinds: frozenset, bias_dtype: torch.dtype | None) -> bool:
    """Tiles of `kinds` serving every step in column order; a bias only of `bias_dtype`
    (None: no bias)."""
    q = linear.quantized
    return q is not None and linear.quantized_max_tokens == sys.maxsize and q.order is None \
        and (linear.bias is None or bias_dtype is not None and _biased(linear, bias_dtype)) \
        and all(s.kind in kinds for s in q.segments)


def _biased(linear, dtype: torch.dtype) -> bool:
    """No bias, or a contiguous one of `dtype` (what moe.cpp reads)."""
    return linear.bias is None or linear.bias.dtype == dtype and linear.bias.is_contiguous()


def _bias_address(linear) -> int:
    return 0 if linear.bias is None else linear.bias.data_ptr()


def _real(value: float) -> int:
    """A float word: the double's bits (moe.cpp's real())."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _address(weight: torch.Tensor) -> int:
    if not weight.is_contiguous():
        raise ValueError("a router's weight must be contiguous")
    return weight.data_ptr()
