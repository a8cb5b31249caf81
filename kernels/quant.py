"""GGUF-quantized weights kept in their quantized form, for the small-batch matmuls.

At batch 1 a decode step reads every weight once and does little else, so its time is the
bytes of weights read: Q4_1 is 0.625 bytes a weight, bfloat16 2. pack() reorders a tensor's
GGUF blocks once, at load, into the tiles csrc/quant_kernels.cpp reads (16 output rows by 32
columns: one SIMD lane per output row; csrc/quant_tiles.h); matmul() runs x @ W^T from them.
The products use each weight's exact value (d * q + m with the file's fp16 d and m), as
dequantizing does; the file's other types become blocks of a tile type holding the same
values (gguf_blocks.py: the K-quants' superblocks before sharing among ranks, the others
here). The K-quants' tiles hold 16 rows by a whole superblock, the file's sub-block scales
as stored beside its fp16 d (Q4_K: 4.625 bits a weight, the file's 4.5).

A Linear (kernels/linear.py) holding a QuantWeight uses it for steps of up to `max_tokens`
tokens and its dense packed copy for larger ones (prefill, big batches), where the matmul is
bound by arithmetic and oneDNN's bfloat16 GEMM is faster.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import native, native_api
from .gguf_blocks import (AS_TILE_BLOCKS, IQ4_NL, IQ4_XSL, IQ4_XSS, MXFP4, Q2_K, Q2_KS, Q4_0,
                          Q4_1, Q4_K, Q4_KS, Q5_0, Q5_1, Q5_K, Q5_KP, Q5_KS, Q6_K, Q6_KP, Q6_KS,
                          Q8_0, SUPER_PARTS, iq4_xs_level_parts, mxfp4_as_level_blocks,
                          super_as_classic, super_parts)

# The tile types and roundings whose sum is a packed weight's kind, as csrc/pagewire_api.h
# declares them (PwTile: GGML's type ids, which gguf_blocks.py names too; PwRounding).
_TILE, _ROUNDING = native_api.API.enums["PwTile"], native_api.API.enums["PwRounding"]
# bytes of one 32-weight block of each type pack() takes: the file's (Q4_0 ... IQ4_NL, MXFP4), or
# its tile types' (gguf_blocks.py makes them of the K-quants and Q5_1)
# FP8: an FP8 checkpoint's e4m3 codes (not a GGML type: pagewire's own id), a block a float32
# scale then 32 codes (checkpoint_formats.py makes them).
FP8 = _TILE["FP8"]
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18, MXFP4: 17,
                Q4_K: 24, Q5_K: 40, Q6_K: 40, Q2_K: 48, FP8: 36,
                **{t: 2 * h + a + q for t, (h, a, q) in SUPER_PARTS.items()}}
# a tile type's scale arrays before its quants in a block (count, bytes each: fp16 or
# float32), and the types whose quants are nibbles (Q4 tiles)
_SCALES = {Q4_1: (2, 2), Q8_0: (1, 2), Q4_K: (2, 4), Q5_K: (2, 4), Q6_K: (2, 4), Q2_K: (4, 4),
           FP8: (1, 4), IQ4_NL: (1, 2), MXFP4: (1, 2)}
_NIBBLES = (Q4_1, Q4_K, Q4_KS)
# Level tiles (csrc/quant_tiles.h Levels): blocks of an fp16 d and 16 bytes of nibbles that
# index a codebook, kept as the file stores them where the library multiplies them
# (native.Library.quant_kind), else their values as Q8_0 tiles (AS_TILE_BLOCKS). MXFP4's
# exponent byte becomes the fp16 d (gguf_blocks.mxfp4_as_level_blocks).
_LEVELS = {IQ4_NL: lambda raw: raw, MXFP4: mxfp4_as_level_blocks}
# Superblock tile types kept nearer the file's bytes where the library has them: (that type,
# its parts from the superblock's: gguf_blocks.super_parts'). IQ4_XSS's whole superblocks
# become IQ4_XSL's level tiles, Q6_KS's and Q5_KS's bit planes (the same parts: _plane_bytes,
# _fifth_bit_bytes).
_PLANES = {Q6_KS: Q6_KP, Q5_KS: Q5_KP}
_STORED_SUPERS = {IQ4_XSS: (IQ4_XSL, iq4_xs_level_parts),
                  **{codes: (planes, lambda parts: parts) for codes, planes in _PLANES.items()}}
_LEVEL_TYPES = (*_LEVELS, IQ4_XSL)
# The superblock tile types (gguf_blocks.SUPER: a K-quant's scales as stored, csrc/quant_tiles.h
# SuperTile), packed 8 blocks a tile where a weight's blocks keep their superblocks whole.
_SUPER = tuple(SUPER_PARTS)
assert all(_TILE[n] == t for n, t in (("Q2_KS", Q2_KS), ("Q4_KS", Q4_KS), ("Q5_KS", Q5_KS),
                                      ("Q6_KS", Q6_KS), ("IQ4_XSS", IQ4_XSS),
                                      ("IQ4_XSL", IQ4_XSL), ("Q6_KP", Q6_KP),
                                      ("Q5_KP", Q5_KP)))
# How a packed weight's tiles meet the activations: as they are ("exact", float32 products),
# or rounded per 32-column block to "int16" (15 bits) or "int8" (llama.cpp's arithmetic); or
# "int8-large": int8 in steps of 8 tokens and more (prefill chunks, big batches: the int8
# GEMMs, csrc/quant_gemm_vnni.h and quant_gemm_int8_avx2.h), the tier's default in smaller
# ones: exact on avx512_bf16, int16 on avx2 and avx512 (Q4 tiles only, whose layout is the
# same for all three).
ROUNDINGS = ("exact", "int16", "int8", "int8-large")
# A packed weight's kind: its tile type plus its rounding's PwRounding (the native entry point
# and the fused decode stack dispatch on these: csrc/quant_kernels.cpp).
_KIND_OFFSET = {rounding: _ROUNDING[rounding.upper().replace("-", "_")]
                for rounding in ("exact", "int8", "int16", "int8-large")}
# Plain bfloat16 tiles (GGML's BF16 type id): a bfloat16 checkpoint's weights, unquantized,
# multiplied by the same entry point (csrc/bf16_matmul.cpp).
BF16 = _TILE["BF16"]
KINDS = (*(t + o for r, o in _KIND_OFFSET.items() for t in (*_SCALES, *_SUPER)
            if (t != FP8 or not o) and (r != "int8-large" or t in _NIBBLES)),
         *(t + _KIND_OFFSET["int8"] for t in _PLANES.values()), BF16)
_ROWS = 16                                   # output rows per tile


class Segment(NamedTuple):
    kind: int                # its tile type, plus its activations' offset (_KIND_OFFSET)
    tiles: torch.Tensor      # uint8 [rows / 16, cols / 32, tile bytes]
    rows: int


class QuantWeight:
    """A [rows, cols] weight's GGUF blocks as tiles, in row segments of one kind each: one for
    a weight of one type; one a type for a fused weight whose sources differ (Q4_K_M's qkv
    with a Q6_K v_proj), each multiplied into its own output columns. `order`: the blocks
    hold the weight's columns in this order (int64 [cols]; a GPTQ act-order checkpoint's,
    whose groups are contiguous only so), and x's columns are taken in it too; None: as
    they are. `table`: what csrc/decode_stack.cpp reads, int64 [count, order address or 0,
    (tiles address, kind, rows) per segment]."""
    __slots__ = ("segments", "rows", "cols", "kernels", "order", "table")

    def __init__(self, segments: list[Segment], cols: int, lib: native.Library,
                 order: torch.Tensor | None = None):
        if not available(lib):
            raise ValueError(f"{lib} has no quantized matmuls")
        if order is not None and (order.dtype != torch.int64 or order.shape != (cols,)):
            raise ValueError(f"a column order must be int64 [{cols}]")
        missing = {s.kind for s in segments if not lib.quant_kind(s.kind)}
        if missing:     # another tier's tiles (bit planes are avx512_bf16's): no kernel to call
            raise ValueError(f"the {lib.tier} kernels multiply no tiles of kind {sorted(missing)}")
        self.segments, self.cols, self.order = segments, cols, order
        self.rows = sum(s.rows for s in segments)
        self.kernels = {dtype: lib.typed("pw_quant_matmul", dtype)
                        for dtype in (torch.bfloat16, torch.float32)}
        self.refresh_table()

    def refresh_table(self) -> None:
        """`table` from the segments' tiles where they are now (after a move)."""
        self.table = torch.tensor([len(self.segments),
                                   0 if self.order is None else self.order.data_ptr(),
                                   *[v for s in self.segments for v in
                                     (s.tiles.data_ptr(), s.kind, s.rows)]])

    @classmethod
    def joined(cls, parts: list["QuantWeight"], lib: native.Library,
               order: torch.Tensor | None = None) -> "QuantWeight":
        """parts' rows one after the other (the same columns, in `order`)."""
        return cls([s for p in parts for s in p.segments], parts[0].cols, lib, order)

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
    """Whether pack() (pack_bf16() for BF16) takes a weight of this type and shape."""
    return (ggml_type in _BLOCK_BYTES or ggml_type == BF16) and rows % _ROWS == 0 \
        and cols % 32 == 0


# The least int16 / float32 multiply-add rate (native.Library.int16_mac_ratio) at which the
# int16 GEMM beats oneDNN's float32 GEMM: its panels, rounding and per-block scales cost
# ~20 % beside the products (bench/NOTES.md "int16 GEMM on AVX2"), so a core whose vpmaddwd
# does no more than its FMAs (Haswell, Zen 1 and 2: ~1x or less) keeps the dense copy; Zen 3
# and 4 measure ~1.6x.
INT16_GEMM_MIN_RATIO = 1.25


def blocks_serve_large_steps(weight: QuantWeight, lib: native.Library,
                             int16_gemm: bool, int8_gemm: bool = False) -> bool:
    """Whether a weight's blocks multiply large steps (prefill chunks, big batches) faster
    than oneDNN's float32 GEMM on a dense copy: int16 activations (every segment) where the
    backend has the int16 GEMM for them (`int16_gemm`: its capabilities' int16_large_steps,
    the avx2 tier's), on a core that issues csrc/quant_gemm_avx2.h's 256-bit vpmaddwd (16
    multiply-adds) at least INT16_GEMM_MIN_RATIO times as fast as float32 FMAs (8). Not on
    avx512, whose oneDNN FMAs are 512 bits wide (Intel's two 512-bit units), nor where
    oneDNN's bfloat16 GEMM runs (avx512_bf16). And int8 activations (every segment) where
    the backend has an int8 GEMM (`int8_gemm`: its capabilities' int8_large_steps): on
    avx512_bf16 vpdpbusd's 64 multiply-adds an instruction run 1.25-1.6x oneDNN's bfloat16
    GEMM (bench/NOTES.md "int8 GEMM on AVX512-VNNI"); on avx2 vpmaddubsw's 32 (four times an
    FMA's) 1.2-2x oneDNN's float32 one (csrc/quant_gemm_int8_avx2.h; bench/NOTES.md "int8
    GEMM on AVX2")."""
    offsets = {s.kind - _tile_type(s.kind) for s in weight.segments}
    if int8_gemm and offsets <= {_KIND_OFFSET["int8"], _KIND_OFFSET["int8-large"]}:
        return True
    return int16_gemm and offsets == {_KIND_OFFSET["int16"]} \
        and lib.int16_mac_ratio >= INT16_GEMM_MIN_RATIO


def _tile_type(kind: int) -> int:
    """A kind's tile type (pagewire_api.h: every PwTile is below PW_ROUNDING_INT8)."""
    return kind % _ROUNDING["INT8"]


def block_bytes(ggml_type: int) -> int:
    """Bytes of one 32-weight block of a type pack() takes (the K-quants: k_quant_blocks')."""
    return _BLOCK_BYTES[ggml_type]


def available(lib: native.Library | None) -> bool:
    """Whether a backend's library has the quantized matmuls (every tier from AVX2 up)."""
    return lib is not None and lib.quant_matmuls


def pack(ggml_type: int, raw: torch.Tensor, cols: int, lib: native.Library,
         rounding: str = "exact", planes: bool = True) -> QuantWeight:
    """raw: uint8 [rows, cols / 32 * block bytes], 32-weight blocks row by row (the file's, or
    for the K-quants gguf_blocks.k_quant_super_blocks' or k_quant_blocks'); the weight
    multiplies with `lib`'s kernels. IQ4_NL and MXFP4 blocks stay level tiles where `lib` has
    them (_LEVELS; IQ4_XSS's whole superblocks IQ4_XSL's, Q6_KS's and Q5_KS's bit planes for
    int8 activations: _STORED_SUPERS); those and Q4_0, Q5_0 and Q5_1 blocks otherwise become
    a tile type's first (AS_TILE_BLOCKS; MXFP4 Q8_0's or Q6_K's); superblock tile blocks
    pack 8 a tile, or as the classic tiles of the same values where a superblock was cut (a
    rank's share of its columns). rounding (one of ROUNDINGS):
    int16 and int8 round the activations per 32-column block and multiply in integers
    (csrc/quant_avx2.h); Q8 tiles (Q8_0, Q6_K, Q5_K) then hold a row's four adjacent columns
    together (Q2_K too). planes=False keeps Q6_KS's and Q5_KS's int8 codes where the library
    has bit planes (to compare the two)."""
    rows = raw.shape[0]
    if not packable(ggml_type, rows, cols):
        raise ValueError(f"cannot pack GGML type {ggml_type} of shape [{rows}, {cols}]")
    if rounding not in ROUNDINGS or ggml_type == FP8 and rounding != "exact":
        raise ValueError(f"rounding must be one of {ROUNDINGS} (FP8: exact), got {rounding!r}")
    if rounding == "int8-large" and ggml_type not in (Q4_0, *_NIBBLES):
        raise ValueError(f"int8-large takes Q4 tiles (Q4_0, Q4_1, Q4_K), not type {ggml_type}")
    levels = _level_blocks(ggml_type, raw, lib, rounding)
    if levels is not None:
        raw = levels
    elif ggml_type in AS_TILE_BLOCKS:
        ggml_type, raw = AS_TILE_BLOCKS[ggml_type](raw)
    parts = super_parts(ggml_type, raw) if ggml_type in _SUPER else None
    if parts is not None and not _whole_superblocks(parts[0], cols):
        ggml_type, raw, parts = *super_as_classic(ggml_type, raw), None
    stored, as_stored = _STORED_SUPERS.get(ggml_type, (None, None))
    if parts is not None and stored is not None and (planes or ggml_type not in _PLANES) and \
            lib.quant_kind(stored + _KIND_OFFSET[rounding]):
        ggml_type, parts = stored, as_stored(parts)
    if parts is not None:
        tiles = _super_tiles(ggml_type, parts, cols, rounding)
    else:
        arrays, width = _SCALES[ggml_type]
        blocks = raw.reshape(rows // _ROWS, _ROWS, cols // 32, -1)
        scales = blocks[..., :arrays * width]                   # [G, 16 rows, nb, arrays * w]
        scales = scales.reshape(*scales.shape[:3], arrays, width).permute(0, 2, 3, 1, 4)
        tiles = torch.cat([_quant_bytes(ggml_type, blocks[..., arrays * width:], rounding),
                           scales.reshape(*scales.shape[:2], -1)], dim=2).contiguous()
    return QuantWeight([Segment(ggml_type + _KIND_OFFSET[rounding], tiles, rows)], cols, lib)


def _level_blocks(ggml_type: int, raw: torch.Tensor, lib: native.Library,
                  rounding: str) -> torch.Tensor | None:
    """A level type's blocks as its level tiles take them, where `lib` multiplies them;
    else None."""
    if ggml_type not in _LEVELS or not lib.quant_kind(ggml_type + _KIND_OFFSET[rounding]):
        return None
    return _LEVELS[ggml_type](raw)


def _level_steps(quants: torch.Tensor) -> torch.Tensor:
    """Level blocks' nibbles [G, nb, 16 rows, 16 bytes] (the file's: byte i holds columns i
    and i + 16) as integer activations' steps [G, nb, 8 steps, 16 rows in the order 0-3, 8-11,
    4-7, 12-15, 2] (csrc/quant_tiles.h level_codes): byte p of step j holds columns 4j + p
    (low nibble) and 4j + 2 + p (high). Columns 4j .. 4j + 3 lie in bytes 4j' .. 4j' + 3
    (j' = j mod 4), low nibbles for j < 4, high for j >= 4; row 8a + 4b + c goes to word
    8b + 4a + c (a, b the row's two upper bits swapped)."""
    g, nb = quants.shape[:2]
    # a quad's two byte pairs as int16 words (bytes 4j', 4j' + 1 | 4j' + 2, 4j' + 3), each
    # mask keeping a nibble of both bytes
    words = quants.contiguous().view(torch.int16).reshape(g, nb, 16, 4, 2)
    first, second = words[..., 0], words[..., 1]
    high = -0x0F10                                           # 0xF0F0 as an int16
    steps = torch.cat([(first & 0x0F0F) | ((second << 4) & high),        # j < 4: low
                       ((first >> 4) & 0x0F0F) | (second & high)], dim=3)   # j >= 4: high
    rows = steps.reshape(g, nb, 2, 2, 4, 8)                  # [G, nb, a, b, c, step]
    return rows.permute(0, 1, 5, 3, 2, 4).contiguous().view(torch.uint8).reshape(
        g, nb, 8, 16, 2)


def _quant_bytes(ggml_type: int, quants: torch.Tensor, rounding: str) -> torch.Tensor:
    """Blocks' quants uint8 [G, 16 rows, nb, bytes] as their tiles hold them, [G, nb, 16 *
    bytes]: nibbles [8 steps][16 rows][2]; Q8 bytes [32 columns][16 rows], or for integer
    activations [8 steps][16 rows][4 adjacent columns]; level tiles' nibbles [16 columns][16
    rows] (exact), or _level_steps'."""
    groups, nb = quants.shape[0], quants.shape[2]
    quants = quants.transpose(1, 2)                                  # [G, nb, 16 rows, bytes]
    if ggml_type == Q6_KP:
        return _plane_bytes(quants)
    if ggml_type == Q5_KP:
        return _fifth_bit_bytes(quants)
    if ggml_type in _LEVEL_TYPES:
        qs = quants.transpose(2, 3) if rounding == "exact" else _level_steps(quants)
    elif ggml_type in _NIBBLES:
        qs = quants.reshape(groups, nb, _ROWS, 8, 2).transpose(2, 3)       # [G,nb,8,16,2]
    elif rounding != "exact":
        qs = quants.reshape(groups, nb, _ROWS, 8, 4).transpose(2, 3)       # [G,nb,8,16,4]
    else:
        qs = quants.transpose(2, 3)                           # [G, nb, 32 columns, 16 rows]
    return qs.reshape(groups, nb, -1)


def _step_pair_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes q uint8 [G, nb, p, half, 16 rows, 4] (pair p's steps: half 0 columns 8p .. 8p + 3,
    half 1 the next four) as a plane tile's 256 nibble bytes [G, nb, 256]: steps 2p, 2p + 1
    in byte 4l + c of pair p, column 8p + c of row l in the low nibble, 8p + 4 + c high."""
    g, nb = q.shape[:2]
    return ((q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)).reshape(g, nb, 256)


def _plane_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Six-bit codes uint8 [G, nb, 16 rows, 32 columns] (int8 -32..31) as Q6_KP's planes
    [G, nb, 384] for int8 activations: 256 bytes of nibbles, then 128 of crumbs, of q = code
    + 32 (csrc/quant_step_vnni.h plane_operands)."""
    g, nb = codes.shape[:2]
    q = (codes.view(torch.int8).to(torch.int16) + 32).to(torch.uint8)
    nibbles = _step_pair_nibbles(q.reshape(g, nb, 16, 4, 2, 4).permute(0, 1, 3, 4, 2, 5))
    # byte 4l + c of pair p: the crumbs of nibble bytes 4l + c (rows l < 8) and 4l + c + 32
    h = (q >> 4).reshape(g, nb, 2, 8, 4, 2, 4)                    # [.., a, l, p, half, c]
    crumbs = (h[:, :, 0, ..., 0, :] | (h[:, :, 1, ..., 0, :] << 2)
              | (h[:, :, 0, ..., 1, :] << 4) | (h[:, :, 1, ..., 1, :] << 6)).permute(
                  0, 1, 3, 2, 4)
    return torch.cat([nibbles, crumbs.reshape(g, nb, 128)], dim=2)


def _fifth_bit_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Five-bit codes uint8 [G, nb, 16 rows, 32 columns] (0..31) as Q5_KP's planes [G, nb,
    320] for int8 activations: 256 bytes of nibbles as Q6_KP's, then 64 of fifth bits, a pair
    of steps two 64-bit masks (csrc/quant_step_vnni.h fifth_bit_operands)."""
    g, nb = codes.shape[:2]
    q = codes.reshape(g, nb, 16, 4, 2, 4).permute(0, 1, 3, 4, 2, 5)   # [G, nb, p, half, l, c]
    # pair p: the low nibbles' mask, then the high ones': bit n (byte n // 8) nibble byte n's
    fifth = (q >> 4).reshape(g, nb, 4, 2, 8, 8).to(torch.int32)    # [G, nb, p, half, byte, bit]
    masks = (fifth << torch.arange(8, dtype=torch.int32)).sum(-1)
    return torch.cat([_step_pair_nibbles(q), masks.to(torch.uint8).reshape(g, nb, 64)], dim=2)


def _whole_superblocks(heads: torch.Tensor, cols: int) -> bool:
    """Whether superblock tile blocks (their heads [rows, nb, H]) hold whole superblocks, 8
    blocks of one head each: not where a rank's share of the columns starts inside one."""
    if cols % 256:
        return False
    heads = heads.reshape(heads.shape[0], cols // 256, 8, -1)
    return bool((heads == heads[:, :, :1]).all())


def _super_tiles(super_type: int, parts: tuple[torch.Tensor, ...], cols: int,
                 rounding: str) -> torch.Tensor:
    """Superblock tiles uint8 [G, cols / 256, bytes] (csrc/quant_tiles.h SuperTile) of the
    blocks' parts (gguf_blocks.super_parts): per 16 rows and 256 columns, the 8 blocks'
    quants as the classic tiles hold them, their int8 scale bytes [8][arrays][16 rows], then
    the fp16 heads [H][16 rows]."""
    heads, scales, quants = parts
    rows, nsb = heads.shape[0], cols // 256
    groups = rows // _ROWS
    q = _quant_bytes(super_type, quants.reshape(groups, _ROWS, nsb * 8, -1), rounding)
    scales = scales.reshape(groups, _ROWS, nsb, 8, -1).permute(0, 2, 3, 4, 1)   # [G,S,8,A,16]
    heads = heads.reshape(groups, _ROWS, nsb, 8, -1)[:, :, :, 0].permute(0, 2, 3, 1)  # [G,S,H,16]
    parts = [q.reshape(groups, nsb, -1), scales.contiguous().view(torch.uint8),
             heads.contiguous().view(torch.uint8)]
    return torch.cat([p.reshape(groups, nsb, -1) for p in parts], dim=2).contiguous()


def pack_bf16(weight: torch.Tensor, lib: native.Library) -> QuantWeight:
    """A bfloat16 [rows, cols] weight (rows a multiple of 16, cols of 32) as BF16 tiles:
    per 16 rows and 32 columns, 16 lines of 64 bytes, line j columns (2j, 2j + 1) of the 16
    rows, a row's pair in one 32-bit lane (csrc/bf16_matmul.cpp)."""
    rows, cols = weight.shape
    if weight.dtype != torch.bfloat16 or not packable(BF16, rows, cols):
        raise ValueError(f"cannot pack a {weight.dtype} [{rows}, {cols}] weight as BF16 tiles")
    pairs = weight.reshape(rows // _ROWS, _ROWS, cols // 32, 16, 2)   # [G, row, B, j, 2]
    # written into a tensor of its own, not a view: a view's base would outlive a move of the
    # tiles (huge_pages.move gives them new storage), holding the weight's bytes twice
    tiles = torch.empty((rows // _ROWS, cols // 32, 1024), dtype=torch.uint8)
    tiles.view(torch.bfloat16).view(rows // _ROWS, cols // 32, 16, _ROWS, 2).copy_(
        pairs.permute(0, 2, 3, 1, 4))
    return QuantWeight([Segment(BF16, tiles, rows)], cols, lib)


def matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x: [T, cols] bfloat16 or float32, rows contiguous -> [T, rows] in x's dtype. The exact
    kernels keep float32 activations' precision; int16 and int8 ones round them (pack()).
    Called per linear per step: the checks are the few the kernel's memory safety needs."""
    fn = weight.kernels.get(x.dtype)
    if fn is None or x.dim() != 2 or x.shape[1] != weight.cols or x.stride(1) != 1:
        raise ValueError(f"quantized matmul: x must be bfloat16 or float32 [T, {weight.cols}] "
                         f"with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    if weight.order is not None:
        x = x.index_select(1, weight.order)
    out = torch.empty((x.shape[0], weight.rows), dtype=x.dtype)
    address, row = out.data_ptr(), 0
    for segment in weight.segments:           # each into its own columns of out's rows
        fn(segment.kind, address + row * out.element_size(), weight.rows, x.data_ptr(),
           x.stride(0), x.shape[0], segment.tiles.data_ptr(), segment.rows, weight.cols)
        row += segment.rows
    return out
