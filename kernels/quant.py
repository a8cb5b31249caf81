"""GGUF-quantized weights kept in their quantized form, for the small-batch matmuls.

At batch 1 a decode step reads every weight once and does little else, so its time is the
bytes of weights read: Q4_1 is 0.625 bytes a weight, bfloat16 2. pack() reorders a tensor's
GGUF blocks once, at load, into the tiles csrc/quant_kernels.cpp reads (16 output rows by 32
columns: one SIMD lane per output row; csrc/quant_tiles.h); matmul() runs x @ W^T from them.
The products use each weight's exact value (d * q + m with the file's fp16 d and m), as
dequantizing does. The K-quants' 256-weight superblocks become 32-weight blocks first
(k_quant_blocks) whose scales, fp16 d times a sub-block's 6- or 8-bit scale, are float32:
exact there, where fp16 would round them.

A Linear (kernels/linear.py) holding a QuantWeight uses it for steps of up to `max_tokens`
tokens and its dense packed copy for larger ones (prefill, big batches), where the matmul is
bound by arithmetic and oneDNN's bfloat16 GEMM is faster.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import native

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, IQ4_NL = 2, 3, 6, 8, 12, 14, 20     # GGML type ids
K_QUANTS = (Q4_K, Q6_K)
# bytes of one 32-weight block as pack() takes it: the file's, or k_quant_blocks()'s (Q4_K:
# f32 d, f32 m, 16 bytes of nibbles; Q6_K: f32 d of columns 0-15 and of 16-31, 32 int8)
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q8_0: 34, Q4_K: 24, Q6_K: 40, IQ4_NL: 18}
# a block's scale arrays before its quants (count, bytes each: fp16 or float32), and the
# types whose quants are nibbles (Q4 tiles)
_SCALES = {Q4_1: (2, 2), Q8_0: (1, 2), Q4_K: (2, 4), Q6_K: (2, 4)}
_NIBBLES = (Q4_1, Q4_K)
# IQ4_NL's 16 levels (ggml's kvalues_iq4nl): a weight is d * level[nibble]
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# How a packed weight's tiles meet the activations: as they are ("exact", float32 products),
# or rounded per 32-column block to "int16" (15 bits) or "int8" (llama.cpp's arithmetic).
ROUNDINGS = ("exact", "int16", "int8")
# A packed weight's kind: its tile type plus 100 for int8 or 200 for int16 activations (the
# native entry point and the fused decode stack dispatch on these: csrc/quant_kernels.cpp).
_KIND_OFFSET = {"exact": 0, "int8": 100, "int16": 200}
KINDS = tuple(t + o for o in _KIND_OFFSET.values() for t in (Q4_1, Q8_0, Q4_K, Q6_K))
_ROWS = 16                                   # output rows per tile


class Segment(NamedTuple):
    kind: int                # its tile type, plus its activations' offset (_KIND_OFFSET)
    tiles: torch.Tensor      # uint8 [rows / 16, cols / 32, tile bytes]
    rows: int


class QuantWeight:
    """A [rows, cols] weight's GGUF blocks as tiles, in row segments of one kind each: one for
    a weight of one type; one a type for a fused weight whose sources differ (Q4_K_M's qkv
    with a Q6_K v_proj), each multiplied into its own output columns. `table`: the segments
    as csrc/decode_stack.cpp reads them, int64 [count, (tiles address, kind, rows) ...]."""
    __slots__ = ("segments", "rows", "cols", "kernels", "table")

    def __init__(self, segments: list[Segment], cols: int, lib: native.Library):
        if not available(lib):
            raise ValueError(f"{lib} has no quantized matmuls")
        self.segments, self.cols = segments, cols
        self.rows = sum(s.rows for s in segments)
        self.kernels = {dtype: lib.typed("pw_quant_matmul", dtype)
                        for dtype in (torch.bfloat16, torch.float32)}
        self.table = torch.tensor([len(segments), *[v for s in segments for v in
                                                    (s.tiles.data_ptr(), s.kind, s.rows)]])

    @classmethod
    def joined(cls, parts: list["QuantWeight"], lib: native.Library) -> "QuantWeight":
        """parts' rows one after the other (the same columns)."""
        return cls([s for p in parts for s in p.segments], parts[0].cols, lib)

    @property
    def kind(self) -> int | None:
        """The kind of a weight of one segment; None for a mixed one."""
        return self.segments[0].kind if len(self.segments) == 1 else None

    @property
    def tiles(self) -> torch.Tensor:
        """A weight of one segment's tiles."""
        (segment,) = self.segments
        return segment.tiles

    @property
    def nbytes(self) -> int:
        return sum(s.tiles.numel() for s in self.segments)


def packable(ggml_type: int, rows: int, cols: int) -> bool:
    return ggml_type in _BLOCK_BYTES and rows % _ROWS == 0 and cols % 32 == 0


def block_bytes(ggml_type: int) -> int:
    """Bytes of one 32-weight block of a type pack() takes (the K-quants: k_quant_blocks')."""
    return _BLOCK_BYTES[ggml_type]


def available(lib: native.Library | None) -> bool:
    """Whether a backend's library has the quantized matmuls (every tier from AVX2 up)."""
    return lib is not None and lib.quant_matmuls


def pack(ggml_type: int, raw: torch.Tensor, cols: int, lib: native.Library,
         rounding: str = "exact") -> QuantWeight:
    """raw: uint8 [rows, cols / 32 * block bytes], 32-weight blocks row by row (the file's, or
    for the K-quants k_quant_blocks'); the weight multiplies with `lib`'s kernels. Q4_0
    blocks become Q4_1 ones (below). rounding (one of ROUNDINGS): int16 and int8 round the
    activations per 32-column block and multiply in integers (csrc/quant_avx2.h); Q8 tiles
    (Q8_0, Q6_K) then hold a row's four adjacent columns together."""
    rows = raw.shape[0]
    if not packable(ggml_type, rows, cols):
        raise ValueError(f"cannot pack GGML type {ggml_type} of shape [{rows}, {cols}]")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if ggml_type in _AS_STORED:
        ggml_type, raw = _AS_STORED[ggml_type](raw)
    nb, (arrays, width) = cols // 32, _SCALES[ggml_type]
    blocks = raw.reshape(rows // _ROWS, _ROWS, nb, _BLOCK_BYTES[ggml_type]).transpose(1, 2)
    groups = blocks.shape[0]                                  # blocks: [G, nb, 16, bytes]
    # each scale array [G, nb, 16 rows, width] becomes 16 lanes after the tile's quants
    scales = [blocks[..., i * width:(i + 1) * width] for i in range(arrays)]
    quants = blocks[..., arrays * width:]
    if ggml_type in _NIBBLES:
        qs = quants.reshape(groups, nb, _ROWS, 8, 2).transpose(2, 3)       # [G,nb,8,16,2]
    elif rounding != "exact":
        qs = quants.reshape(groups, nb, _ROWS, 8, 4).transpose(2, 3)       # [G,nb,8,16,4]
    else:
        qs = quants.transpose(2, 3)                           # [G, nb, 32 columns, 16 rows]
    tiles = torch.cat([p.reshape(groups, nb, -1) for p in [qs, *scales]], dim=2).contiguous()
    return QuantWeight([Segment(ggml_type + _KIND_OFFSET[rounding], tiles, rows)], cols, lib)


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


def q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K superblocks uint8 [n, 144] (fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and
    eight 6-bit mins, 128 bytes of nibbles) -> (scale, minimum: float32 [n, 8], exact;
    quants uint8 [n, 8, 32]): weight i of sub-block j is scale[j] * q[j, i] + minimum[j]."""
    n = blocks.shape[0]
    s = blocks[:, 4:16]
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)        # 32 bytes: sub-block 2g low, 2g + 1 high
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    return _f16(blocks, 0) * sc.float(), -_f16(blocks, 2) * mn.float(), q


def q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K superblocks uint8 [n, 210] (128 bytes of low nibbles, 64 of high bit pairs, 16
    int8 scales, fp16 d) -> (scale float32 [n, 16], exact; quants int8 [n, 16, 16] in
    -32..31): weight i of sub-block j is scale[j] * q[j, i]."""
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16)
    return _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float(), q


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def k_quant_blocks(ggml_type: int, raw: torch.Tensor) -> torch.Tensor:
    """A K-quant tensor's superblocks uint8 [rows, cols / 256 * bytes] as the 32-weight blocks
    pack() takes, uint8 [rows, cols / 32 * block_bytes(type)], holding the same values:
    Q4_K: (scale, minimum) float32, then the sub-block's nibbles in Q4_1's order (weights 0-15
    low, 16-31 high); Q6_K: its two 16-weight sub-blocks' scales float32, then 32 int8."""
    rows = raw.shape[0]
    if ggml_type == Q4_K:
        scale, minimum, q = q4_k_parts(raw.reshape(-1, 144))
        qs = q[..., :16] | (q[..., 16:] << 4)                         # [n, 8, 16]
        head = torch.stack([scale, minimum], dim=-1)                  # [n, 8, 2]
    elif ggml_type == Q6_K:
        scale, q = q6_k_parts(raw.reshape(-1, 210))
        qs = q.reshape(-1, 8, 32).view(torch.uint8)
        head = scale.reshape(-1, 8, 2)
    else:
        raise ValueError(f"GGML type {ggml_type} is not a K-quant pack() takes")
    blocks = torch.cat([head.contiguous().view(torch.uint8), qs], dim=-1)
    return blocks.reshape(rows, -1)


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
    address, row = out.data_ptr(), 0
    for segment in weight.segments:           # each into its own columns of out's rows
        fn(segment.kind, address + row * out.element_size(), weight.rows, x.data_ptr(),
           x.stride(0), x.shape[0], segment.tiles.data_ptr(), segment.rows, weight.cols)
        row += segment.rows
    return out
