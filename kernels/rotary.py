"""Rotary position embedding, neox style (rotate halves), as Llama-family models use it: the
torch reference and the Triton kernel."""
from __future__ import annotations

import math

import torch

from ._triton import (HAS_TRITON, check, check_float, check_same_device, next_pow2,
                      out_or_new, require_triton, tl, triton)


def rope_cos_sin(head_dim: int, max_position: int, theta: float,
                 inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """The [max_position, head_dim] table of (cos | sin) halves, in float32. `inv_freq` may be
    given by a scaled variant; the default is theta ** (-2i / head_dim)."""
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)                           # [P, D]


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  max_position: int | None = None,
                  seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention factor) for a rope scaling config in
    Hugging Face's form ({"rope_type": "yarn", "factor": 4.0, ...}; None: plain rope), the
    values transformers' ROPE_INIT_FUNCTIONS give. The attention factor multiplies cos and
    sin (yarn's mscale; 1.0 otherwise). `dynamic` is NTK scaling as of `seq_len` tokens
    (default max_position: at or below it, plain rope)."""
    scaling = scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if kind == "default":
        return 1.0 / theta ** exponents, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return 1.0 / theta ** exponents / factor, 1.0
    if kind == "dynamic":
        length = max(seq_len or max_position, max_position)
        base = theta * (factor * length / max_position - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / base ** exponents, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(1.0 / theta ** exponents, factor, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, factor, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, factor: float, scaling: dict) -> tuple[torch.Tensor, float]:
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) \
            if mscale and mscale_all else _yarn_mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos_sin: [T, D] rows already gathered at each token's position and
    cast to x's dtype. Returns a new [T, heads, D]."""
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)    # [T, 1, D/2] each
    x1, x2 = x.chunk(2, dim=-1)                         # [T, heads, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def partial_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary_dim: int, table: torch.Tensor, positions: torch.Tensor):
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D] with the first rotary_dim
    columns of each q and k head rotated (rotate-half pairs, as GPT-NeoX; 0: none, as GPT-2's
    learned positions). table: [P, rotary_dim] (cos | sin)."""
    t, d, r = qkv.shape[0], head_dim, rotary_dim
    q_size, kv_size = num_heads * d, num_kv_heads * d
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(t, num_heads, d), k.view(t, num_kv_heads, d)
    if r:
        cos_sin = table[positions].to(qkv.dtype)                              # [T, r]
        q = torch.cat([apply_rope(q[..., :r], cos_sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :r], cos_sin), k[..., r:]], dim=-1)
    return q, k, v.view(t, num_kv_heads, d)


if HAS_TRITON:
    @triton.jit
    def _rope_kernel(x_ptr, out_ptr, cs_ptr, pos_ptr, num_heads, half,
                     stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
                     HAS_POSITIONS: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
        """One program per token: all its heads rotated by one cos|sin row (row t, or row
        positions[t] of a table). Float32 math. out may be x (in place)."""
        t = tl.program_id(0).to(tl.int64)
        if HAS_POSITIONS:
            row = tl.load(pos_ptr + t)
        else:
            row = t
        cols = tl.arange(0, BLOCK_HALF)
        c_mask = cols < half
        cos = tl.load(cs_ptr + row * stride_cs + cols, mask=c_mask, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + row * stride_cs + half + cols, mask=c_mask,
                      other=0.0).to(tl.float32)
        heads = tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < num_heads) & c_mask[None, :]
        src = x_ptr + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
        tl.store(dst, x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
        tl.store(dst + half, x2 * cos[None, :] + x1 * sin[None, :], mask=mask)


def _launch_rope(x, out, cos_sin, positions):
    tokens, num_heads, head_dim = x.shape
    if tokens:
        _rope_kernel[(tokens,)](
            x, out, cos_sin, positions if positions is not None else cos_sin, num_heads,
            head_dim // 2, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            cos_sin.stride(0), HAS_POSITIONS=positions is not None,
            BLOCK_H=next_pow2(num_heads), BLOCK_HALF=next_pow2(head_dim // 2))
    return out


def _check_x(x: torch.Tensor) -> None:
    check(x.dim() == 3, f"x must be [T, heads, D], got {tuple(x.shape)}")
    check(x.shape[2] % 2 == 0, f"x: head_dim must be even, got {x.shape[2]}")
    check_float("x", x)
    check(x.stride(-1) == 1, "x: last dimension must be contiguous")


def triton_rope(x: torch.Tensor, cos_sin: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """As apply_rope: x [T, heads, D] (token and head strides free, last dimension
    contiguous); cos_sin [T, D] (any float dtype; the math is float32). Returns out, a new
    [T, heads, D] unless given (out=x rotates in place)."""
    require_triton()
    _check_x(x)
    tokens, _, head_dim = x.shape
    check(tuple(cos_sin.shape) == (tokens, head_dim),
          f"cos_sin must be [{tokens}, {head_dim}], got {tuple(cos_sin.shape)}")
    check_float("cos_sin", cos_sin)
    check(cos_sin.stride(-1) == 1, "cos_sin: last dimension must be contiguous")
    out = out_or_new(out, x.shape, x)
    check_same_device(x=x, cos_sin=cos_sin, out=out)
    return _launch_rope(x, out, cos_sin, None)


def triton_rope_table_(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate x [T, heads, D] IN PLACE by rows positions[t] of table [P, D] (rope_cos_sin's
    float32 table): the gather fused into the kernel. positions: [T] int64, contiguous."""
    require_triton()
    _check_x(x)
    tokens, _, head_dim = x.shape
    check(table.dim() == 2 and table.shape[1] == head_dim,
          f"table must be [P, {head_dim}], got {tuple(table.shape)}")
    check_float("table", table)
    check(table.stride(-1) == 1, "table: last dimension must be contiguous")
    check(positions.dtype == torch.int64 and tuple(positions.shape) == (tokens,)
          and positions.is_contiguous(),
          f"positions must be contiguous [{tokens}] int64, got {tuple(positions.shape)} "
          f"{positions.dtype}")
    check_same_device(x=x, table=table, positions=positions)
    _launch_rope(x, x, table, positions)
