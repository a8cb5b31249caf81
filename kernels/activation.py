"""SiLU-and-multiply: the gated MLP's activation over a fused gate/up projection: the torch
reference and the Triton kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import (HAS_TRITON, check, check_float, check_same_device, next_pow2,
                      out_or_new, require_triton, tl, triton)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2*I] (gate first, then up) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' activation, [T, 2*I] (gate first, then up) -> [T, I]: the gate
    clamped above at `limit`, up to [-limit, limit], then gate * sigmoid(alpha gate) * (up + 1),
    in transformers' order of operations (GptOssExperts._apply_gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's activation: GELU (tanh approximation) of the gate times up. [T, 2*I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


if HAS_TRITON:
    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
        """Program (token, column tile): silu(gate) in float32, cast to the input dtype (as
        F.silu rounds), times up."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, silu * up.to(tl.float32), mask=mask)


def triton_silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """As silu_and_mul, one Triton launch. gate_up [T, 2I] (rows may be strided, last
    dimension contiguous) -> out [T, I] (new unless given)."""
    require_triton()
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
          f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    check_float("gate_up", gate_up)
    check(gate_up.stride(-1) == 1, "gate_up: last dimension must be contiguous")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = out_or_new(out, (tokens, inter), gate_up)
    check_same_device(gate_up=gate_up, out=out)
    block = min(1024, next_pow2(inter))
    if tokens and inter:
        _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
