"""Token sampling for a batch of rows with per-row parameters: the torch reference the engine
runs, the one place that picks the native CPU draw, and a Triton top-k / top-p kernel.

A row is either greedy (the argmax of its logits) or random: its logits are divided by its
temperature, cut by top-k, top-p and min-p, and one token is drawn by inverting the cumulative
distribution. The draw takes one uniform u in (0, 1] per row, supplied by the caller, and picks
the first token whose cumulative probability reaches u times the row's total: one random number
per row instead of one per vocabulary entry (as the exponential race, argmax p / E, needs), and
whoever supplies the uniforms decides reproducibility (the engine seeds them per request).

Cuts, per row: tokens outside the top_k most likely are masked to -inf (top_k <= 0 or >= vocab:
no top-k); then, over the renormalized survivors in order of likelihood, a token is masked when
the probability mass before it is >= top_p (top_p >= 1: no top-p, even where the cumulative sum
rounds to 1 before the tail); then tokens whose probability is below min_p times the top one's
are masked (min_p 0: no min-p). The most likely token always survives every cut.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import native
from ._triton import HAS_TRITON, check, check_same_device, out_or_new, require_triton, tl, triton


@dataclass
class SamplingTensors:
    """Per-row parameters, rows following the logits' rows. A greedy row takes the argmax
    whatever its other fields hold. Held on the CPU (as the engine builds them), they let
    sample() tell which stages some row needs without waiting on the logits' device."""
    temperature: torch.Tensor      # [S] float32; 1: no scaling
    top_k: torch.Tensor            # [S] int64; <= 0 or >= vocab: no top-k
    top_p: torch.Tensor            # [S] float32 in (0, 1]; >= 1: no top-p
    min_p: torch.Tensor            # [S] float32 in [0, 1]; 0: no min-p
    greedy: torch.Tensor           # [S] bool
    # How a host tensor reaches the logits' device without waiting for the work queued there
    # (the engine's backend: through pinned memory); None: a plain copy, which may wait.
    upload: Callable[[torch.Tensor], torch.Tensor] | None = None

    def on(self, t: torch.Tensor, logits: torch.Tensor, dtype=None) -> torch.Tensor:
        """A per-row tensor derived from these, where `logits` are (as `dtype`)."""
        t = self.upload(t) if self.upload is not None else t.to(logits.device)
        return t if dtype is None else t.to(dtype)


def sample(logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor,
           lib: native.Library | None = None) -> torch.Tensor:
    """logits [S, V] float32 (overwritten: scaled and cut in place); uniforms [S] or [S, 1] in
    (0, 1], on the logits' device -> token ids [S] int64. `lib`: the backend's native library
    (its draw runs where it serves)."""
    if bool(params.greedy.all()):
        return logits.argmax(dim=-1)
    greedy_tokens = logits.argmax(dim=-1) if bool(params.greedy.any()) else None
    sampled = draw(sampling_logits(logits, params), uniforms, lib)
    if greedy_tokens is None:
        return sampled
    return torch.where(params.on(params.greedy, logits), greedy_tokens, sampled.to(logits.device))


def sampling_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The logits the random rows draw from: divided by the temperature, then cut by top-k,
    top-p and min-p. Greedy rows pass through unchanged. logits [S, V] float32 are scaled in
    place; returns them or a cut copy. A stage no row uses costs nothing, so a batch at
    temperature 1 is not divided."""
    random = ~params.greedy
    temperature = torch.where(random, params.temperature, 1.0)
    if bool((temperature != 1.0).any()):
        logits.div_(params.on(temperature, logits, logits.dtype).unsqueeze(1))
    vocab = logits.shape[1]
    top_k = torch.where(random, params.top_k, 0)
    top_p = torch.where(random, params.top_p, 1.0)
    if bool((((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)).any()):
        logits = top_k_top_p_mask(logits, top_k, top_p, params.on)
    min_p = torch.where(random, params.min_p, 0.0)
    if bool((min_p > 0).any()):
        min_p_mask_(logits, min_p, params.on)
    return logits


def probabilities(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The distributions random rows draw from: softmax of sampling_logits (logits [S, V]
    float32 are scaled in place) -> [S, V]."""
    return torch.softmax(sampling_logits(logits, params), dim=-1)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     accept_u: list[float], draw_u: list[float]) -> list[int]:
    """Speculative sampling of one sequence (Leviathan et al. 2023, Chen et al. 2023): p
    [k + 1, V] the target's distributions at the k drafts' positions and the one after, q
    [k, V] those the drafts were drawn from, accept_u [k] and draw_u [k + 1] independent
    uniforms in (0, 1]. Draft i is kept while accept_u[i] * q[i, x] <= p[i, x]; at the first
    refused one a token is drawn from max(p - q, 0) renormalized (it is never the refused
    draft), and after k kept ones one from p[k]. Every token follows p exactly, whatever q
    is. Returns the kept drafts and that token."""
    for i, x in enumerate(drafts):
        if accept_u[i] * float(q[i, x]) <= float(p[i, x]):
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:       # p <= q everywhere: only rounding refused x
            residual = p[i]
        return drafts[:i] + [_draw_weights(residual, draw_u[i])]
    return drafts + [_draw_weights(p[len(drafts)], draw_u[len(drafts)])]


def _draw_weights(weights: torch.Tensor, u: float) -> int:
    """The first token whose cumulative weight reaches u of the total."""
    cdf = weights.double().cumsum(0)
    return int(torch.searchsorted(cdf, cdf[-1:] * u).clamp_(max=len(cdf) - 1))


def _to(t: torch.Tensor, logits: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.to(logits.device, dtype)


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     on=_to) -> torch.Tensor:
    """logits [S, V]; top_k [S] int; top_p [S] float. Returns a masked copy (the module
    docstring's top-k and top-p cuts). `on(t, logits, dtype)`: a per-row tensor moved where
    the logits are (SamplingTensors.on)."""
    vocab = logits.shape[1]
    k = on(torch.where((top_k > 0) & (top_k < vocab), top_k, vocab), logits)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)                                  # [S, V] in sorted order
    sorted_logits.masked_fill_(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = on(top_p, logits, probs.dtype).unsqueeze(1)
    drop |= (mass_before >= p) & (p < 1.0)      # top_p = 1 keeps the tail cumsum rounds to 1
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def min_p_mask_(logits: torch.Tensor, min_p: torch.Tensor, on=_to) -> None:
    """Mask, in place, each row's tokens less likely than min_p [S] times its top token (which
    min_p <= 1 always keeps)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * on(min_p, logits, probs.dtype).unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def draw(logits: torch.Tensor, uniforms: torch.Tensor,
         lib: native.Library | None = None) -> torch.Tensor:
    """Per row of logits [S, V], the first token whose cumulative softmax probability reaches
    uniforms [S] or [S, 1] (in (0, 1]) of the total; -inf logits weigh nothing. `lib`'s native
    kernel where it serves (float32 logits on the CPU, every tier: three passes over each row
    while it sits in L2, no [S, V] temporaries), else the search."""
    if lib is not None and lib.sample_serves(logits):
        return lib.sample_rows(logits, uniforms)
    return draw_by_search(logits, uniforms)


def draw_by_search(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """draw on any device (softmax, cumulative sum, search): the reference for the native
    kernel."""
    cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)                # [S, V]
    target = uniforms.reshape(-1, 1).mul(cdf[:, -1:])                  # [S, 1] in (0, total]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=cdf.shape[1] - 1)


if HAS_TRITON:
    @triton.jit
    def _ordered_key(x):
        """float32 -> int32 with the same order (-inf lowest; -0.0 just below +0.0)."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _top_k_top_p_kernel(x_ptr, out_ptr, k_ptr, p_ptr, vocab, stride_x, stride_o,
                            BLOCK: tl.constexpr):
        """One program per row. Without sorting: each threshold is found by bisection over
        the 32-bit ordered keys of the logits, one pass over the row per step. Keeps the
        tokens whose key is >= both thresholds."""
        row = tl.program_id(0).to(tl.int64)
        src = x_ptr + row * stride_x
        k = tl.load(k_ptr + row)
        top_p = tl.load(p_ptr + row)
        min_key = k * 0 - 2147483648                       # int64 scalars
        k_thresh = min_key
        p_thresh = min_key
        if (k > 0) & (k < vocab):
            # the largest t with count(key >= t) >= k: the k-th largest key
            lo = min_key
            hi = k * 0 + 2147483647
            for _ in range(32):
                mid = lo + (hi - lo + 1) // 2
                count = 0
                for v0 in range(0, vocab, BLOCK):
                    cols = v0 + tl.arange(0, BLOCK)
                    x = tl.load(src + cols, mask=cols < vocab, other=float("-inf"))
                    hit = (_ordered_key(x) >= mid) & (cols < vocab)
                    count += tl.sum(hit.to(tl.int32), 0)
                lo = tl.where(count >= k, mid, lo)
                hi = tl.where(count >= k, hi, mid - 1)
            k_thresh = lo
        if top_p < 1.0:
            top = float("-inf")
            for v0 in range(0, vocab, BLOCK):
                cols = v0 + tl.arange(0, BLOCK)
                x = tl.load(src + cols, mask=cols < vocab, other=float("-inf"))
                top = tl.maximum(top, tl.max(x, 0))
            total = 0.0
            for v0 in range(0, vocab, BLOCK):
                cols = v0 + tl.arange(0, BLOCK)
                x = tl.load(src + cols, mask=cols < vocab, other=float("-inf"))
                kept = (_ordered_key(x) >= k_thresh) & (cols < vocab)
                total += tl.sum(tl.where(kept, tl.exp(x - top), 0.0), 0)
            target = top_p * total
            # the smallest t whose mass strictly above it is < top_p (the top key always
            # qualifies: a token survives when the mass before it is < top_p)
            lo = min_key - 1
            hi = _ordered_key(top).to(tl.int64)
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                mass = 0.0
                for v0 in range(0, vocab, BLOCK):
                    cols = v0 + tl.arange(0, BLOCK)
                    x = tl.load(src + cols, mask=cols < vocab, other=float("-inf"))
                    key = _ordered_key(x)
                    above = (key > mid) & (key >= k_thresh) & (cols < vocab)
                    mass += tl.sum(tl.where(above, tl.exp(x - top), 0.0), 0)
                lo = tl.where(mass < target, lo, mid)
                hi = tl.where(mass < target, mid, hi)
            p_thresh = hi
        dst = out_ptr + row * stride_o
        for v0 in range(0, vocab, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < vocab, other=float("-inf"))
            key = _ordered_key(x)
            keep = (key >= k_thresh) & (key >= p_thresh)
            tl.store(dst + cols, tl.where(keep, x, float("-inf")), mask=cols < vocab)


def triton_top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
                            out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """As top_k_top_p_mask, one Triton launch (a program per row). logits [S, V] float32,
    rows may be strided; top_k [S] int64; top_p [S] float32. Returns out (new unless given;
    out=logits masks in place). Ties differ from the sorting reference: tokens whose logit
    equals the k-th largest, or the last one top-p keeps, are all kept or all dropped."""
    require_triton()
    check(logits.dim() == 2, f"logits must be [S, V], got {tuple(logits.shape)}")
    check(logits.dtype == torch.float32, f"logits: dtype must be float32, got {logits.dtype}")
    check(logits.stride(-1) == 1, "logits: last dimension must be contiguous")
    rows, vocab = logits.shape
    check(top_k.dtype == torch.int64 and tuple(top_k.shape) == (rows,) and top_k.is_contiguous(),
          f"top_k must be contiguous [{rows}] int64, got {tuple(top_k.shape)} {top_k.dtype}")
    check(top_p.dtype == torch.float32 and tuple(top_p.shape) == (rows,)
          and top_p.is_contiguous(),
          f"top_p must be contiguous [{rows}] float32, got {tuple(top_p.shape)} {top_p.dtype}")
    check(block >= 16 and block & (block - 1) == 0, "block: a power of 2, >= 16")
    out = out_or_new(out, (rows, vocab), logits)
    check_same_device(logits=logits, top_k=top_k, top_p=top_p, out=out)
    if rows and vocab:
        _top_k_top_p_kernel[(rows,)](logits, out, top_k, top_p, vocab, logits.stride(0),
                                     out.stride(0), BLOCK=block)
    return out
