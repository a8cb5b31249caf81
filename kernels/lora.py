"""LoRA deltas of one linear over a step's rows, each row with its adapter (or none): the
weights' layout, the torch reference and the Triton kernel. The native CPU kernel is
csrc/lora.cpp.

`adapters` pairs each adapter's {slot: LoraWeights} with its rows (an int64 index tensor into
y and x): y [T, N] += scale (x[rows] A^T) Bt for every adapter holding the slot.
"""
from __future__ import annotations

import functools

import torch

from ._triton import HAS_TRITON, check, check_same_device, next_pow2, require_triton, tl, triton
from .native_api import API

# The weight dtypes csrc/lora.cpp reads, by their codes (csrc/pagewire_api.h PwLoraWeights).
_CODES = API.enums["PwLoraWeights"]
KINDS = {torch.float32: _CODES["F32"], torch.bfloat16: _CODES["BF16"],
         torch.float16: _CODES["F16"]}
ENTRY = API.enums["PwLoraTable"]["ENTRY"]   # int64 per (adapter, slot) in the native table


class LoraWeights:
    """One adapter's weights for one (fused) linear of N outputs, in the dtype they come in
    (float32, bfloat16 or float16: the file's, or the model's where narrower; executor/lora.py).
    A [R, K] stacks the A matrices of the projections the linear fuses. B^T of such a linear
    is block-diagonal (projection j's rank rows reach only its own output columns), so only
    its blocks are kept: `parts` [(r0, r1, col, Bt_j [r1 - r0, w_j])], views into one packed
    array `bt`, and `spans` [R, 3] int64 (col, width, offset into `bt`) per rank row, for the
    native kernel."""

    def __init__(self, a: torch.Tensor, blocks: list[tuple[int, torch.Tensor]], scale: float,
                 n: int):
        """blocks: (col, Bt_j [r_j, w_j]) in A's rank order; Bt_j = B_j^T, unscaled."""
        check(a.dtype in KINDS, f"LoRA weights of dtype {a.dtype} are not supported")
        self.a, self.scale, self.n = a.contiguous(), float(scale), n
        self.bt = torch.cat([b.to(a.dtype).reshape(-1) for _, b in blocks])
        self._blocks, spans, r0, offset = [], [], 0, 0
        for col, b in blocks:
            r, w = b.shape
            self._blocks.append((r0, r0 + r, col, offset, w))
            spans += [(col, w, offset + i * w) for i in range(r)]
            r0, offset = r0 + r, offset + r * w
        check(r0 == a.shape[0], "LoRA weights: the blocks' ranks must sum to A's rows")
        cols = sorted((col, col + b.shape[1]) for col, b in blocks)
        check(all(end <= start for (_, end), (start, _) in zip(cols, cols[1:])),
              "LoRA weights: blocks of B^T share no column (the native kernel adds each once)")
        self.spans = torch.tensor(spans, dtype=torch.int64)

    @property
    def parts(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """The blocks (r0, r1, col, Bt_j [r1 - r0, w_j]) as views of `bt` wherever it is now
        (executor/huge_pages.py may move it)."""
        return [(r0, r1, col, self.bt[offset:offset + (r1 - r0) * w].view(r1 - r0, w))
                for r0, r1, col, offset, w in self._blocks]

    def entry(self) -> list[int]:
        """The native table's row: (A, Bt, spans pointers, R, Kind, scale as float64 bits)."""
        scale_bits = torch.tensor([self.scale], dtype=torch.float64).view(torch.int64).item()
        return [self.a.data_ptr(), self.bt.data_ptr(), self.spans.data_ptr(), self.a.shape[0],
                KINDS[self.a.dtype], scale_bits]

    @functools.cached_property
    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [R, K], Bt [R, N] with the scale folded in) in float32: the Triton kernel's."""
        bt = torch.zeros(self.a.shape[0], self.n, device=self.a.device)
        for r0, r1, col, b in self.parts:
            bt[r0:r1, col:col + b.shape[1]] = b.float() * self.scale
        return self.a.float(), bt


def adapted_linear(ops, linear, x: torch.Tensor, lora) -> torch.Tensor:
    """ops.linear(linear, x), plus the LoRA delta of each row's adapter where it adapts the
    linear (`lora`: executor/lora.py LoraBatch of x's rows, or None). A row-parallel linear's
    float32 partial takes its rank's partial delta."""
    y = ops.linear(linear, x)
    if lora is not None and linear.lora_slot >= 0:
        ops.lora_delta(y, x.to(y.dtype), lora, linear.lora_slot)
    return y


def lora_delta(y: torch.Tensor, x: torch.Tensor, adapters, slot: int) -> None:
    for weights, rows in adapters:
        lw = weights.get(slot)
        if lw is None or not rows.numel():
            continue
        mid = (x.index_select(0, rows).float() @ lw.a.float().T) * lw.scale       # [n, R]
        for r0, r1, col, b in lw.parts:
            y[:, col:col + b.shape[1]].index_add_(
                0, rows, (mid[:, r0:r1] @ b.float()).to(y.dtype))


def stacked_dense(weights: list[dict], slot: int) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor] | None:
    """The step's adapters' dense weights for linear `slot`, stacked for one launch:
    (A [L, R, K], Bt [L, R, N] scaled, ranks [L] int32; R the largest rank, a smaller one
    zero-padded; an adapter that leaves the linear alone has rank 0), or None where none of
    them touches it. `weights`: each adapter's {slot: LoraWeights}."""
    held = [w.get(slot) for w in weights]
    present = [lw for lw in held if lw is not None]
    if not present:
        return None
    rank = max(lw.a.shape[0] for lw in present)
    k, n, device = present[0].a.shape[1], present[0].n, present[0].a.device
    a = torch.zeros(len(held), rank, k, device=device)
    bt = torch.zeros(len(held), rank, n, device=device)
    for i, lw in enumerate(held):
        if lw is not None:
            dense_a, dense_bt = lw.dense
            a[i, :dense_a.shape[0]], bt[i, :dense_bt.shape[0]] = dense_a, dense_bt
    ranks = torch.tensor([0 if lw is None else lw.a.shape[0] for lw in held],
                         dtype=torch.int32, device=device)
    return a, bt, ranks


if HAS_TRITON:
    @triton.jit
    def _lora_kernel(y_ptr, x_ptr, of_row_ptr, a_ptr, bt_ptr, ranks_ptr, n, k, rank,
                     stride_y, stride_x,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (row, column tile) of every row of the step: its adapter's (none: the
        row's y is left as it is) mid = A x[row] in float32 (each tile computes it: R is
        small), then the tile's columns of y[row] += mid Bt."""
        row = tl.program_id(0).to(tl.int64)
        adapter = tl.load(of_row_ptr + row)
        held = adapter >= 0
        adapter = tl.maximum(adapter, 0).to(tl.int64)
        r = tl.where(held, tl.load(ranks_ptr + adapter), 0)
        a_ptr += adapter * rank * k
        bt_ptr += adapter * rank * n
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
        mask = outs < tl.where(held, n, 0)                # a base row's y stays as it is
        y = tl.load(y_ptr + row * stride_y + outs, mask=mask, other=0.0)
        tl.store(y_ptr + row * stride_y + outs, (y.to(tl.float32) + delta).to(y.dtype),
                 mask=mask)


def triton_lora_delta(y: torch.Tensor, x: torch.Tensor, adapter_of_row: torch.Tensor,
                      stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """As lora_delta, in one launch for every row and column tile, whatever the adapters:
    adapter_of_row [T] int64 (-1: the base model), `stacked` as stacked_dense gives (None:
    no adapter touches the linear). y, x: rows may be strided, last dimension contiguous."""
    require_triton()
    check(y.stride(-1) == 1 and x.stride(-1) == 1, "lora_delta: last dimensions contiguous")
    if stacked is None:
        return
    a, bt, ranks = stacked
    tokens, n = y.shape
    k = x.shape[1]
    check(a.is_contiguous() and bt.is_contiguous() and a.shape[2] == k and
          bt.shape == (*a.shape[:2], n) and adapter_of_row.shape == (tokens,) and
          adapter_of_row.dtype == torch.int64,
          "lora_delta: A [L, R, K] and Bt [L, R, N] contiguous, adapter_of_row int64 [T]")
    check_same_device(y=y, x=x, adapter_of_row=adapter_of_row, a=a, bt=bt, ranks=ranks)
    block_n = min(256, next_pow2(n))
    _lora_kernel[(tokens, triton.cdiv(n, block_n))](
        y, x, adapter_of_row, a, bt, ranks, n, k, a.shape[1], y.stride(0), x.stride(0),
        BLOCK_R=max(16, next_pow2(a.shape[1])), BLOCK_K=min(128, next_pow2(k)),
        BLOCK_N=block_n)
