"""LoRA deltas of one linear over a step's rows, each row with its adapter (or none): the
torch reference and the Triton kernel. The native CPU kernel is csrc/lora.cpp.

An adapter's weights for the linear are A [R, K] and Bt [R, N] (B transposed, its scale
folded in), float32; `adapters` pairs each adapter's {slot: (A, Bt)} with its rows (an int64
index tensor into y and x). y [T, N] += (x[rows] A^T) Bt for every adapter holding the slot.
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, check, check_same_device, next_pow2, require_triton, tl, triton


def lora_delta(y: torch.Tensor, x: torch.Tensor, adapters, slot: int) -> None:
    for weights, rows in adapters:
        ab = weights.get(slot)
        if ab is not None and rows.numel():
            a, bt = ab
            delta = (x.index_select(0, rows).float() @ a.T) @ bt                  # [n, N]
            y.index_add_(0, rows, delta.to(y.dtype))


if HAS_TRITON:
    @triton.jit
    def _lora_kernel(y_ptr, x_ptr, rows_ptr, a_ptr, bt_ptr, n, k, r, stride_y, stride_x,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (row, column tile): mid = A x[row] in float32 (each tile computes it: R
        is small), then the tile's columns of y[row] += mid Bt."""
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
        ranks = tl.arange(0, BLOCK_R)
        mid = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0.0)
            a = tl.load(a_ptr + ranks[:, None] * k + cols[None, :],
                        mask=(ranks[:, None] < r) & (cols[None, :] < k), other=0.0)
            mid += tl.sum(a * xk.to(tl.float32)[None, :], axis=1)
        outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        bt = tl.load(bt_ptr + ranks[:, None] * n + outs[None, :],
                     mask=(ranks[:, None] < r) & (outs[None, :] < n), other=0.0)
        delta = tl.sum(bt * mid[:, None], axis=0)
        y = tl.load(y_ptr + row * stride_y + outs, mask=outs < n, other=0.0)
        tl.store(y_ptr + row * stride_y + outs, (y.to(tl.float32) + delta).to(y.dtype),
                 mask=outs < n)


def triton_lora_delta(y: torch.Tensor, x: torch.Tensor, adapters, slot: int) -> None:
    """As lora_delta: one launch per adapter holding the slot (a step has at most max_loras),
    every row of it and every column tile at once. y, x: rows may be strided, last dimension
    contiguous."""
    require_triton()
    check(y.stride(-1) == 1 and x.stride(-1) == 1, "lora_delta: last dimensions contiguous")
    tokens, n = y.shape
    k = x.shape[1]
    for weights, rows in adapters:
        ab = weights.get(slot)
        if ab is None or not rows.numel():
            continue
        a, bt = ab
        check(a.is_contiguous() and bt.is_contiguous() and a.shape[1] == k and
              bt.shape == (a.shape[0], n), "lora_delta: A [R, K] and Bt [R, N] contiguous")
        check_same_device(y=y, x=x, rows=rows, a=a, bt=bt)
        block_n = min(256, next_pow2(n))
        _lora_kernel[(rows.numel(), triton.cdiv(n, block_n))](
            y, x, rows, a, bt, n, k, a.shape[0], y.stride(0), x.stride(0),
            BLOCK_R=max(16, next_pow2(a.shape[0])), BLOCK_K=min(128, next_pow2(k)),
            BLOCK_N=block_n)
