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

import torch


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
    float32 where moe.float_partial (a rank's partial sum), else x's dtype."""
    weights, experts = route(ops.linear(moe.router, x), moe.top_k, moe.normalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, tokens, slots in by_expert(experts):
        expert = moe.experts[str(e)] if str(e) in moe.experts else None
        if expert is None:                              # another rank's (expert parallel)
            continue
        y = _expert(ops, expert, x[tokens])
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
    if moe.shared is not None:
        gate = torch.sigmoid(ops.linear(moe.shared_gate, x).float())     # [T, 1]
        out += gate * _expert(ops, moe.shared, x).float()
    return out if moe.float_partial else out.to(x.dtype)


def _expert(ops, expert, x: torch.Tensor) -> torch.Tensor:
    return ops.linear(expert.down, ops.silu_and_mul(ops.linear(expert.gate_up, x)))
