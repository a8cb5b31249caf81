"""GGUF-quantized weights kept in their quantized form, for the small-batch matmuls.

At batch 1 a decode step reads every weight once and does little else, so its time is the
bytes of weights read: Q4_1 is 0.625 bytes a weight, bfloat16 2. pack() reorders a tensor's
GGUF blocks once, at load, into the tiles csrc/quant_kernels.cpp reads (16 output rows by 32
columns: one SIMD lane per output row); matmul() runs x @ W^T from them. The products use
each weight's exact value (d * q + m with the file's fp16 d and m), as dequantizing does.

A Linear (kernels/linear.py) holding a QuantWeight uses it for steps of up to `max_tokens`
tokens and its dense packed copy for larger ones (prefill, big batches), where the matmul is
bound by arithmetic and oneDNN's bfloat16 GEMM is faster.
"""
from __future__ import annotations

import torch

from . import native

Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL = 2, 3, 6, 8, 20            # GGML type ids
# bytes of one 32-weight block in the file
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q8_0: 34, IQ4_NL: 18}
# IQ4_NL's 16 levels (ggml's kvalues_iq4nl): a weight is d * level[nibble]
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# How a packed weight's tiles meet the activations: as they are ("exact", float32 products),
# or rounded per 32-column block to "int16" (15 bits) or "int8" (llama.cpp's arithmetic).
ROUNDINGS = ("exact", "int16", "int8")
# A packed weight's kind: its GGML type plus 100 for int8 or 200 for int16 activations (the
# fused decode stack dispatches on these, csrc/decode_stack.cpp).
Q4_1_I8, Q8_0_I8, Q4_1_I16, Q8_0_I16 = 103, 108, 203, 208
KINDS = (Q4_1, Q8_0, Q4_1_I8, Q8_0_I8, Q4_1_I16, Q8_0_I16)
_KIND_OFFSET = {"exact": 0, "int8": 100, "int16": 200}
_KERNELS = {Q4_1: "pw_q4_1_matmul", Q8_0: "pw_q8_0_matmul", Q4_1_I8: "pw_q4_1_i8_matmul",
            Q8_0_I8: "pw_q8_0_i8_matmul", Q4_1_I16: "pw_q4_1_i16_matmul",
            Q8_0_I16: "pw_q8_0_i16_matmul"}
_ROWS = 16                                   # output rows per tile


class QuantWeight:
    """A [rows, cols] weight's GGUF blocks as tiles: uint8 [rows / 16, cols / 32, tile], and
    the native kernels that multiply them, by activation dtype."""
    __slots__ = ("ggml_type", "kind", "tiles", "rows", "cols", "kernels")

    def __init__(self, ggml_type: int, tiles: torch.Tensor, rows: int, cols: int,
                 lib: native.Library, rounding: str = "exact"):
        if not available(lib):
            raise ValueError(f"{lib} has no quantized matmuls")
        self.ggml_type, self.tiles, self.rows, self.cols = ggml_type, tiles, rows, cols
        self.kind = ggml_type + _KIND_OFFSET[rounding]
        self.kernels = {dtype: lib.typed(_KERNELS[self.kind], dtype)
                        for dtype in (torch.bfloat16, torch.float32)}

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()


def packable(ggml_type: int, rows: int, cols: int) -> bool:
    return ggml_type in _BLOCK_BYTES and rows % _ROWS == 0 and cols % 32 == 0


def block_bytes(ggml_type: int) -> int:
    """Bytes of one 32-weight block of a type pack() takes."""
    return _BLOCK_BYTES[ggml_type]


def available(lib: native.Library | None) -> bool:
    """Whether a backend's library has the quantized matmuls (every tier from AVX2 up)."""
    return lib is not None and lib.quant_matmuls


def pack(ggml_type: int, raw: torch.Tensor, cols: int, lib: native.Library,
         rounding: str = "exact") -> QuantWeight:
    """raw: uint8 [rows, cols / 32 * block bytes], the file's blocks row by row; the weight
    multiplies with `lib`'s kernels. Q4_0 blocks become Q4_1 ones (below). rounding (one of
    ROUNDINGS): int16 and int8 round the activations per 32-column block and multiply in
    integers (csrc/quant_avx2.h); Q8_0 tiles then hold a row's four adjacent columns together."""
    rows = raw.shape[0]
    if not packable(ggml_type, rows, cols):
        raise ValueError(f"cannot pack GGML type {ggml_type} of shape [{rows}, {cols}]")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if ggml_type in _AS_STORED:
        ggml_type, raw = _AS_STORED[ggml_type](raw)
    nb = cols // 32
    blocks = raw.reshape(rows // _ROWS, _ROWS, nb, _BLOCK_BYTES[ggml_type]).transpose(1, 2)
    groups = blocks.shape[0]                                  # blocks: [G, nb, 16, bytes]
    if ggml_type == Q4_1:
        d, m = blocks[..., 0:2], blocks[..., 2:4]             # fp16 scale and minimum
        qs = blocks[..., 4:].reshape(groups, nb, _ROWS, 8, 2).transpose(2, 3)   # [G,nb,8,16,2]
        parts = [qs, d, m]
    elif rounding != "exact":
        d = blocks[..., 0:2]
        qs = blocks[..., 2:].reshape(groups, nb, _ROWS, 8, 4).transpose(2, 3)   # [G,nb,8,16,4]
        parts = [qs, d]
    else:
        d = blocks[..., 0:2]
        qs = blocks[..., 2:].transpose(2, 3)                  # [G, nb, 32 columns, 16 rows]
        parts = [qs, d]
    tiles = torch.cat([p.reshape(groups, nb, -1) for p in parts], dim=2).contiguous()
    return QuantWeight(ggml_type, tiles, rows, cols, lib, rounding)


def q4_0_as_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks [rows, nb * 18] (d, 16 bytes of nibbles; a weight is d * (q - 8)) as Q4_1
    blocks [rows, nb * 20] (d, m, the same nibbles; d * q + m) with m = -8 d, which fp16 holds
    exactly (a power-of-two multiple), so every tier's Q4_1 kernel multiplies the file's
    exact values."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    d = blocks[..., 0:2].contiguous().view(torch.float16)             # [rows, nb, 1]
    m = d * -8
    if not torch.isfinite(m).all():
        raise ValueError("Q4_0 scale too large for fp16 minimum (|d| > 8188)")
    out = torch.cat([blocks[..., 0:2], m.view(torch.uint8), blocks[..., 2:]], dim=2)
    return out.reshape(raw.shape[0], -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: low nibbles (weights 0-15), then high (16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def q5_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks [rows, nb * 22] (d, 4 bytes of fifth bits, 16 bytes of nibbles; a weight
    is d * (q - 16), q in 0..31) as Q8_0 blocks [rows, nb * 34] (d, q - 16 as int8): the
    same values, 34 bytes a block instead of 22."""
    blocks = raw.reshape(raw.shape[0], -1, 22)
    high = blocks[..., 2:6].contiguous().view(torch.int32)                   # [rows, nb, 1]
    fifth = (high >> torch.arange(32, dtype=torch.int32)) & 1                 # [rows, nb, 32]
    q = _nibbles(blocks[..., 6:]).to(torch.int32) | (fifth << 4)
    codes = (q - 16).to(torch.int8).view(torch.uint8)
    return torch.cat([blocks[..., 0:2], codes], dim=2).reshape(raw.shape[0], -1)


def iq4_nl_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """IQ4_NL blocks [rows, nb * 18] (d, 16 bytes of nibbles indexing IQ4_NL_LEVELS) as Q8_0
    blocks (d, the levels as int8): the same values."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.int8)
    codes = levels[_nibbles(blocks[..., 2:]).long()].view(torch.uint8)
    return torch.cat([blocks[..., 0:2], codes], dim=2).reshape(raw.shape[0], -1)


# Types the kernels multiply as blocks of another type that holds the same values.
_AS_STORED = {Q4_0: lambda raw: (Q4_1, q4_0_as_q4_1(raw)),
              Q5_0: lambda raw: (Q8_0, q5_0_as_q8_0(raw)),
              IQ4_NL: lambda raw: (Q8_0, iq4_nl_as_q8_0(raw))}


def matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x: [T, cols] bfloat16 or float32, rows contiguous -> [T, rows] in x's dtype. The exact
    kernels keep float32 activations' precision; int16 and int8 ones round them (pack()).
    Called per linear per step: the checks are the few the kernel's memory safety needs."""
    fn = weight.kernels.get(x.dtype)
    if fn is None or x.dim() != 2 or x.shape[1] != weight.cols or x.stride(1) != 1:
        raise ValueError(f"quantized matmul: x must be bfloat16 or float32 [T, {weight.cols}] "
                         f"with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    out = torch.empty((x.shape[0], weight.rows), dtype=x.dtype)
    fn(out.data_ptr(), weight.rows, x.data_ptr(), x.stride(0), x.shape[0],
       weight.tiles.data_ptr(), weight.rows, weight.cols)
    return out

