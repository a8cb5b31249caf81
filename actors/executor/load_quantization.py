"""--quantization int8|int4: a float checkpoint's linears rounded, as they load, to the GGML
blocks the quantized kernels multiply (kernels/quant.py): int8 -> Q8_0 (32 columns of a row
share a float16 scale: round to nearest), int4 -> Q4_1 (a float16 scale and minimum per 32
columns: 16 levels), the LM head Q8_0 in both (as llama.cpp's 4-bit files keep their output
layer wider). The model's float weights become those blocks' exact values, so a prefill (the
float GEMMs) and a decode step (the blocks, where the backend has the kernels) compute with
the same weights, as for a GGUF file.
"""
from __future__ import annotations

import torch

from pagewire.kernels import quant

from . import weight_cache
from .gguf_weights import dequantize_rows

MODES = ("none", "int8", "int4")


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K a multiple of 32) -> GGML Q8_0 blocks, uint8 [N, K / 32 * 34]."""
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).to(torch.float16)                  # [N, nb, 1]
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (b * inv).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], -1).reshape(n, -1)


def q4_1_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> GGML Q4_1 blocks, uint8 [N, K / 32 * 20]: scale d and minimum m (float16),
    then 16 bytes holding values 0-15 in their low nibbles and 16-31 in their high ones."""
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    lo = b.amin(-1, keepdim=True)
    d = ((b.amax(-1, keepdim=True) - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = ((b - m.float()) * inv).round().clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([d.view(torch.uint8), m.view(torch.uint8), qs], -1).reshape(n, -1)


_BLOCKS = {quant.Q8_0: q8_0_blocks, quant.Q4_1: q4_1_blocks}


def round_weight(w: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks, the weight they hold as w's dtype)."""
    raw = _BLOCKS[ggml_type](w)
    return raw, dequantize_rows(ggml_type, raw).to(w.dtype)


def round_linears(state: dict[str, torch.Tensor], linears: list[str], mode: str,
                  digest: str | None = None) -> dict[str, tuple[int, torch.Tensor]]:
    """Round the weights of the `linears` (module names) in a fused, unsharded state dict
    whose shape the blocks take (in_features a multiple of 32, out_features of 16): each
    state entry (and a tied embedding with it) is replaced by the blocks' values, in its
    dtype. Returns {module name: (GGML type, blocks)} for linear_blocks.keep_quantized, which
    shares them among tensor-parallel ranks as it shares the weights. With the model's
    `digest`, the blocks are cached (weight_cache.py): a restart reads them and only
    dequantizes."""
    dtype = state[linears[0] + ".weight"].dtype
    cached = weight_cache.load(digest, dtype, mode) if digest else None
    blocks = {}
    for name in linears:
        w = state[name + ".weight"]
        if not quant.packable(quant.Q8_0, *w.shape):
            continue
        ggml = quant.Q8_0 if mode == "int8" or name == "lm_head" else quant.Q4_1
        if cached is not None and name in cached:
            raw = cached[name]
            values = dequantize_rows(ggml, raw).to(w.dtype)
        else:
            raw, values = round_weight(w, ggml)
        blocks[name] = (ggml, raw)
        for key in [k for k, t in state.items() if t is w]:      # a tied embedding too
            state[key] = values
    if digest and (cached is None or set(cached) != set(blocks)):
        weight_cache.store(digest, dtype, {n: raw for n, (_, raw) in blocks.items()}, mode)
    return blocks
