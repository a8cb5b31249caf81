"""Mixture-of-experts: routing in the models' own arithmetic, then each chosen expert run
once over the tokens that chose it.

route() is the one routing every backend uses: softmax of the router logits in float32 (the
Hugging Face models' arithmetic, which Mixtral, Qwen2/3-MoE and OLMoE share), the top k
(ties: the lower expert index first, a rule of ours: torch.topk, which transformers calls,
states none), and, where the model says so, the k weights rescaled to sum to one.

sparse_mlp() groups the step's (token, choice) pairs by expert: an expert no token chose is
never read (a decode step streams only its tokens' experts' weights), and an expert chosen
by many tokens multiplies them as one matrix (a prefill chunk's GEMM per expert). A token
may choose an expert once (topk picks distinct experts); several tokens choosing the same
expert are rows of its one matmul. Outputs are weighted and summed in float32, rounded once.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from .native_api import API

# The words of a block's description for csrc/moe.cpp (pagewire_api.h PwMoe).
MoeWord = API.int_enum("PwMoe", "MoeWord", __name__)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64)."""
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


def sparse_mlp(ops, moe, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H]: the routed experts' weighted sum (plus the gated shared expert),
    through `ops` (the backend's linear and activation). `moe`: models/moe.py SparseMoE.
    float32 where moe.float_partial (a rank's partial sum), else x's dtype. The router's and
    the shared gate's products are float32 (the weights and x widened, summed unrounded)."""
    weights, experts = block_route(moe, x)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    groups = by_expert(experts)
    if moe.reads is not None:
        moe.reads += len(groups)
    for e, tokens, slots in groups:
        if str(e) not in moe.experts:                   # another rank's (expert parallel)
            continue
        y = _expert(ops, moe.experts[str(e)], x[tokens])
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
    add_shared(ops, moe, x, out)
    return out if moe.float_partial else out.to(x.dtype)


def block_route(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """route() of the block's router product (float32): (weights [T, k], experts [T, k])."""
    return route(_float_product(x, moe.router), moe.top_k, moe.normalize)


def add_shared(ops, moe, x: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H] float32 += the gated shared expert's output (Qwen2-MoE), where it has one."""
    if moe.shared is not None:
        gate = torch.sigmoid(_float_product(x, moe.shared_gate))         # [T, 1]
        out += gate * _expert(ops, moe.shared, x).float()


def _float_product(x: torch.Tensor, linear) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), linear.weight.float())


def _expert(ops, expert, x: torch.Tensor) -> torch.Tensor:
    return ops.linear(expert.down, ops.silu_and_mul(ops.linear(expert.gate_up, x)))


class NativeMoe(NamedTuple):
    """A block as csrc/moe.cpp runs it: its PwMoe words (int64), for activations of `dtype`.
    Valid while the block's weights stay where they are (the backend lays it out last)."""
    words: torch.Tensor
    dtype: torch.dtype


def native_spec(moe, kinds: frozenset) -> NativeMoe | None:
    """`moe` (models/moe.py SparseMoE) for the native kernels, or None where they cannot run
    it: every expert's weights (the shared expert's too) tiles of `kinds` serving every step,
    in column order, without bias; one rank's whole output (not a float partial)."""
    dtype = moe.router.weight.dtype
    experts = [*moe.experts.values(), *([moe.shared] if moe.shared is not None else [])]
    if moe.float_partial or dtype not in (torch.bfloat16, torch.float32) or not all(
            _tiled(linear, kinds) for e in experts for linear in (e.gate_up, e.down)):
        return None
    words = [0] * (MoeWord.EXPERT_TABLES + 2 * moe.num_experts)
    words[MoeWord.EXPERTS], words[MoeWord.TOP_K] = moe.num_experts, moe.top_k
    words[MoeWord.NORMALIZE], words[MoeWord.HIDDEN] = int(moe.normalize), moe.router.in_features
    words[MoeWord.ROUTER] = _address(moe.router.weight)
    words[MoeWord.READS] = 0 if moe.reads is None else moe.reads.data_ptr()
    for index, expert in moe.experts.items():
        at = MoeWord.EXPERT_TABLES + 2 * int(index)
        words[at:at + 2] = expert.gate_up.quantized.table.data_ptr(), \
            expert.down.quantized.table.data_ptr()
    words[MoeWord.INTER] = next(iter(moe.experts.values())).down.in_features
    if moe.shared is not None:
        words[MoeWord.SHARED_GATE_UP] = moe.shared.gate_up.quantized.table.data_ptr()
        words[MoeWord.SHARED_DOWN] = moe.shared.down.quantized.table.data_ptr()
        words[MoeWord.SHARED_GATE] = _address(moe.shared_gate.weight)
        words[MoeWord.SHARED_INTER] = moe.shared.down.in_features
    return NativeMoe(torch.tensor(words, dtype=torch.int64), dtype)


def _tiled(linear, kinds: frozenset) -> bool:
    q = linear.quantized
    return q is not None and linear.quantized_max_tokens == sys.maxsize and q.order is None \
        and linear.bias is None and all(s.kind in kinds for s in q.segments)


def _address(weight: torch.Tensor) -> int:
    if not weight.is_contiguous():
        raise ValueError("a router's weight must be contiguous")
    return weight.data_ptr()
