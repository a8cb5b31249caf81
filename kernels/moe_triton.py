"""The Triton fused mixture-of-experts: every (token, expert) pair of a step in two GEMM
launches, whatever experts the tokens chose. The torch reference is kernels/moe.py
sparse_mlp, which TritonOps falls back to where this cannot run it.

A step's pairs (token t, choice slot j: pair t * k + j) are sorted by expert and each
expert's run padded to a multiple of BLOCK_M (align_by_expert, as vLLM's
moe_align_block_size), so every row block of the GEMM belongs to one expert: a program
multiplies its block's rows by that expert's slice of the stacked weights [E, N, K]. An
expert no token chose owns no block and is never read. The alignment is computed in torch
without a host synchronisation (fixed-size buffers, the used length a device scalar the
kernel reads), so a decode step using it can be captured as a CUDA graph.

fused_moe: gate_up GEMM (rows gathered from x) -> SiLU(gate) * up -> down GEMM, each product
rounded to x's dtype as a Linear's output is (kernels/moe.py rounds each expert's output),
then times its routing weight in float32 -> the k choices summed in float32, rounded once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import moe as torch_moe
from ._triton import (FLOAT_DTYPES, HAS_TRITON, check, check_float, check_same_device,
                      require_triton, tl, triton)
from .activation import triton_silu_and_mul

if HAS_TRITON:
    @triton.jit
    def _moe_gemm_kernel(
            a_ptr, w_ptr, c_ptr, sorted_ptr, experts_ptr, used_ptr, weights_ptr,
            num_pairs, a_div, N, K, stride_am, stride_we, stride_wn, stride_cm,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            WEIGHTED: tl.constexpr, ROUND: tl.constexpr, WIDEN: tl.constexpr):
        """Program (row block, column tile): c[pair, cols] = a[pair // a_div] @ w[e, cols]^T
        for the block's pairs (padding rows, pair == num_pairs, read and write nothing);
        ROUND: the product rounded to a's dtype first; WEIGHTED: times weights[pair].
        WIDEN: operands widened to float32 before tl.dot (exact products, the same float32
        sums): the interpreter's bfloat16 tl.dot multiplies the raw bits
        (triton-lang/triton#11584, unsupported there)."""
        block = tl.program_id(0)
        used = tl.load(used_ptr)
        if block * BLOCK_M < used:
            e = tl.load(experts_ptr + block).to(tl.int64)
            pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
            valid = pairs < num_pairs
            rows = pairs // a_div
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = cols < N
            w_base = w_ptr + e * stride_we + cols[None, :] * stride_wn
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :],
                            mask=valid[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & n_mask[None, :],
                            other=0.0)                                      # [BLOCK_K, BLOCK_N]
                if WIDEN:
                    acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(a, w, input_precision="ieee")
            if ROUND:
                acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
            if WEIGHTED:
                acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
            tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :],
                     acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


class MoeAlignment(NamedTuple):
    """A step's (token, choice) pairs grouped by expert into blocks of `block_m` rows.
    sorted_ids [capacity] int64: pair indices (token * k + slot), by expert and within one
    expert by pair (tokens ascending); each expert's run padded to a multiple of block_m
    with num_pairs (read as no pair), and past the used length num_pairs too.
    expert_ids [capacity // block_m] int64: each block's expert (its index in the stacked
    weights), -1 past the used blocks. used [1] int64: the used length, a multiple of
    block_m. capacity bounds any routing of these many pairs, so it depends on the shapes
    alone."""
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    used: torch.Tensor
    block_m: int
    num_pairs: int


def align_by_expert(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                    expert_map: torch.Tensor | None = None) -> MoeAlignment:
    """topk_ids [T, k] (global expert indices) -> MoeAlignment over `num_experts` stacked
    experts. expert_map [E_global] int64: each global expert's stacked index, -1 for one
    this rank does not hold (its pairs are left out: they read and write nothing); None:
    the stacked index is the global one. No host synchronisation."""
    flat = topk_ids.flatten()
    pairs, dev = flat.numel(), flat.device
    local = flat if expert_map is None else expert_map[flat]
    local = torch.where(local >= 0, local, num_experts)      # not held: a last bucket, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, local, torch.ones_like(local))   # (bincount would synchronise)
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    busy = min(num_experts, pairs)                           # experts that can own blocks
    capacity = -(-(pairs + busy * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(local, stable=True)
    expert = local[order].clamp(max=num_experts - 1)
    firsts = torch.cumsum(counts, 0) - counts                # each expert's first place in order
    dest = ends[expert] - padded[expert] + torch.arange(pairs, device=dev) - firsts[expert]
    dest = torch.where(local[order] < num_experts, dest, capacity)   # dropped: a spare slot
    sorted_ids = torch.full((capacity + 1,), pairs, dtype=torch.int64, device=dev)
    sorted_ids[dest] = order
    starts = torch.arange(0, capacity, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, starts, right=True)   # the run holding each start
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return MoeAlignment(sorted_ids[:capacity], expert_ids, ends[-1:], block_m, pairs)


class MoeBlocks(NamedTuple):
    """Tile sizes of the GEMM kernel (each >= 16: tl.dot's least on a GPU)."""
    m: int = 64
    n: int = 64
    k: int = 64


def default_blocks(num_pairs: int, num_experts: int) -> MoeBlocks:
    """Small row blocks where experts get few rows each (decode): less padding to multiply.
    Untuned: the shapes depend on the step's size alone, so graphs replay them."""
    return MoeBlocks(m=16 if num_pairs <= 16 * num_experts else 64)


def moe_gemm(a: torch.Tensor, w: torch.Tensor, align: MoeAlignment, out: torch.Tensor,
             a_div: int, blocks: MoeBlocks, weights: torch.Tensor | None = None,
             round_products: bool = True) -> torch.Tensor:
    """One launch: out[p] = a[p // a_div] @ w[expert of p]^T for every aligned pair p (other
    rows of out untouched), times weights.flatten()[p] (float32) where given, each product
    rounded to a's dtype first where round_products. a [R, K], w [E, N, K], out [pairs, N]."""
    require_triton()
    check(w.dim() == 3 and a.dim() == 2 and a.shape[1] == w.shape[2],
          f"a [R, K] and w [E, N, K] must agree, got {tuple(a.shape)}, {tuple(w.shape)}")
    check_float("a", a)
    check_float("w", w, a.dtype)
    check(tuple(out.shape) == (align.num_pairs, w.shape[1]),
          f"out: shape must be {(align.num_pairs, w.shape[1])}, got {tuple(out.shape)}")
    check(a.stride(-1) == 1 and w.stride(-1) == 1 and out.stride(-1) == 1,
          "a, w and out: last dimension must be contiguous")
    check(align.block_m == blocks.m, "align: block_m must be the kernel's row block")
    if weights is not None:
        check(weights.dtype == torch.float32 and weights.is_contiguous()
              and weights.numel() == align.num_pairs, "weights: float32 [T, k], contiguous")
    check_same_device(a=a, w=w, out=out, sorted_ids=align.sorted_ids)
    n, k = w.shape[1], w.shape[2]
    grid = (align.expert_ids.numel(), triton.cdiv(n, blocks.n))
    if grid[0] and n:
        _moe_gemm_kernel[grid](
            a, w, out, align.sorted_ids, align.expert_ids, align.used,
            align.sorted_ids if weights is None else weights, align.num_pairs, a_div, n, k,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0), BLOCK_M=blocks.m,
            BLOCK_N=blocks.n, BLOCK_K=blocks.k, WEIGHTED=weights is not None,
            ROUND=round_products, WIDEN=not a.is_cuda)
    return out


def fused_moe_float(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    expert_map: torch.Tensor | None = None, float_partial: bool = False,
                    blocks: MoeBlocks | None = None) -> torch.Tensor:
    """fused_moe's float32 sum, unrounded (kernels/moe.py adds the shared expert to it).
    float_partial: the down products stay float32 (a row-parallel rank's partial)."""
    check(x.dim() == 2 and topk_ids.dim() == 2 and topk_weights.shape == topk_ids.shape
          and topk_ids.shape[0] == x.shape[0], "x [T, H], topk_weights and topk_ids [T, k]")
    check(w13.shape[0] == w2.shape[0] and w13.shape[1] == 2 * w2.shape[2]
          and w2.shape[1] == x.shape[1], "w13 must be [E, 2I, H] and w2 [E, H, I]")
    tokens, top_k = topk_ids.shape
    blocks = blocks or default_blocks(tokens * top_k, w13.shape[0])
    align = align_by_expert(topk_ids, blocks.m, w13.shape[0], expert_map)
    x = x.contiguous()
    # Every pair's row is written but those of another rank's experts: zeros there, so the
    # activation reads no garbage (its rows are never read after).
    new = torch.empty if expert_map is None else torch.zeros
    gate_up = new(tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, align, gate_up, top_k, blocks, round_products=False)   # the store rounds
    act = triton_silu_and_mul(gate_up)
    down = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    moe_gemm(act, w2, align, down, 1, blocks, topk_weights.float().contiguous(),
             round_products=not float_partial)
    return down.view(tokens, top_k, -1).sum(1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              expert_map: torch.Tensor | None = None, float_partial: bool = False,
              blocks: MoeBlocks | None = None) -> torch.Tensor:
    """x [T, H] through each token's k experts: w13 [E, 2I, H] (gate rows, then up), w2
    [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] int64 (kernels/moe.py route)
    -> [T, H] in x's dtype (float32 where float_partial). Two GEMM launches and one
    activation launch, whatever the routing."""
    out = fused_moe_float(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                          float_partial=float_partial, blocks=blocks)
    return out if float_partial else out.to(x.dtype)


class StackedExperts(NamedTuple):
    """A block's experts as fused_moe reads them: w13 [E_held, 2I, H], w2 [E_held, H, I],
    held experts in ascending global index; expert_map [E] int64 (global -> stacked, -1 for
    another rank's), None where every expert is held. The experts' Linear weights are views
    of these stacks, so the weights are held once."""
    w13: torch.Tensor
    w2: torch.Tensor
    expert_map: torch.Tensor | None


def stacked_experts(sparse) -> StackedExperts | None:
    """The block's (models/moe.py SparseMoE) StackedExperts, built on first use and kept on
    it as `triton_experts` (rebuilt if its weights were replaced since); None where an
    expert's Linears are not plain dense weights (quantized, packed, biased)."""
    held = sorted(sparse.experts, key=int)
    cached = getattr(sparse, "triton_experts", None)
    if cached is False:
        return None
    first = sparse.experts[held[0]].gate_up.weight if held else None
    if first is not None and cached is not None and first.data_ptr() == cached.w13.data_ptr():
        return cached
    linears = [(sparse.experts[i].gate_up, sparse.experts[i].down) for i in held]
    if first is None or not all(_dense(lin, first) for pair in linears for lin in pair):
        sparse.triton_experts = False
        return None
    stacks = []
    with torch.inference_mode(False):          # plain tensors, as the weights were loaded
        for which in range(2):                 # gate_up, then down: rebound as stack views
            stack = torch.stack([pair[which].weight.detach() for pair in linears])
            for pair, view in zip(linears, stack):
                pair[which].weight = nn.Parameter(view, requires_grad=False)
            stacks.append(stack)
    expert_map = None
    if [int(i) for i in held] != list(range(sparse.num_experts)):
        expert_map = torch.full((sparse.num_experts,), -1, dtype=torch.int64,
                                device=first.device)
        expert_map[[int(i) for i in held]] = torch.arange(len(held), device=first.device)
    sparse.triton_experts = StackedExperts(stacks[0], stacks[1], expert_map)
    return sparse.triton_experts


def _dense(linear, like: torch.Tensor) -> bool:
    w = linear.weight
    return w is not None and linear.quantized is None and linear.packed is None \
        and linear.bias is None and w.dtype == like.dtype and w.device == like.device \
        and w.dtype in FLOAT_DTYPES


def triton_moe_block(ops, sparse, x: torch.Tensor, experts: StackedExperts) -> torch.Tensor:
    """kernels/moe.py sparse_mlp's contract with the routed experts fused (fused_moe); the
    shared expert, where the block has one, through ops as sparse_mlp runs it."""
    weights, ids = torch_moe.block_route(sparse, x)
    if sparse.reads is not None:      # the distinct experts chosen, counted on the device
        chosen = torch.zeros(sparse.num_experts, dtype=torch.int64, device=ids.device)
        sparse.reads += chosen.index_fill_(0, ids.flatten(), 1).sum().to(sparse.reads.device)
    out = fused_moe_float(x, experts.w13, experts.w2, weights, ids,
                          expert_map=experts.expert_map, float_partial=sparse.float_partial)
    torch_moe.add_shared(ops, sparse, x, out)
    return out if sparse.float_partial else out.to(x.dtype)
