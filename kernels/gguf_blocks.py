"""GGUF's block formats: their parts, and the blocks of the same values the tiles take.

kernels/quant.py packs 32-weight blocks of six classic tile types: Q4_1 (fp16 d and m,
nibbles), Q8_0 (fp16 d, int8), Q4_K (float32 d and m, nibbles), Q6_K (two float32 d, one per 16
columns, int8), Q5_K (float32 d and m, int8) and Q2_K (two float32 d and two m, int8). The
file's other types become blocks of one of those holding exactly the same values
(AS_TILE_BLOCKS): a K-quant's effective scale, fp16 d times a sub-block's 6- or 8-bit scale, is
exact in float32, not in fp16; MXFP4's doubled e2m1 levels are int8 codes under its
power-of-two scale (Q8_0's fp16 d, or Q6_K's float32 where fp16 cannot hold it). The K-quants
and IQ4_XS become blocks of superblock tile types instead (k_quant_super_blocks: the scales as
stored beside the fp16 d), which pack() lays out a superblock a tile. The *_parts functions
also serve dequantization (actors/executor/gguf_weights.py).
"""
from __future__ import annotations

import torch

# GGML type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = 2, 3, 6, 7, 8, 20
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 10, 11, 12, 13, 14, 23
# bytes of a 256-weight superblock in the file
K_QUANTS = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
SUPERBLOCKS = {**K_QUANTS, IQ4_XS: 136}   # the types of 256-weight superblocks
# IQ4_NL's 16 levels (ggml's kvalues_iq4nl): a weight is d * level[nibble]
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4 (gpt-oss's experts): a block is one E8M0 exponent byte e, then 16 bytes of 32 e2m1
# nibbles (weights 0-15 low, 16-31 high). ggml stores the e2m1 values doubled (kvalues_mxfp4)
# and halves the scale: a weight is 2^(e - 128) * level[nibble], e in 0..255 (scales all
# finite; the largest levels under e >= 253 overflow float32 to inf, in ggml as here).
MXFP4 = 39
MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# the exponents whose scale 2^(e - 128) fp16 holds exactly (2^-24, its least subnormal, to
# 2^15): a tensor's blocks all in this range become Q8_0 blocks, others Q6_K's float32 scales
MXFP4_FP16_EXPONENTS = range(128 - 24, 128 + 16)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block [..., bytes], as float32 [..., 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: low nibbles (weights 0-15), then high (16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _fifth_bits(high: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] its bits, bit i at i."""
    word = high.contiguous().view(torch.int32)                               # [..., 1]
    return (word >> torch.arange(32, dtype=torch.int32)) & 1


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


def q5_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks [rows, nb * 22] (d, 4 bytes of fifth bits, 16 bytes of nibbles; a weight
    is d * (q - 16), q in 0..31) as Q8_0 blocks [rows, nb * 34] (d, q - 16 as int8): the
    same values, 34 bytes a block instead of 22."""
    blocks = raw.reshape(raw.shape[0], -1, 22)
    q = _nibbles(blocks[..., 6:]).to(torch.int32) | (_fifth_bits(blocks[..., 2:6]) << 4)
    codes = (q - 16).to(torch.int8).view(torch.uint8)
    return torch.cat([blocks[..., 0:2], codes], dim=2).reshape(raw.shape[0], -1)


def q5_1_as_q5_k(raw: torch.Tensor) -> torch.Tensor:
    """Q5_1 blocks [rows, nb * 24] (fp16 d and m, 4 bytes of fifth bits, 16 of nibbles; a
    weight is d * q + m, q in 0..31) as Q5_K tile blocks [rows, nb * 40] (d and m float32,
    q as int8): the same values."""
    blocks = raw.reshape(raw.shape[0], -1, 24)
    q = _nibbles(blocks[..., 8:]).to(torch.int32) | (_fifth_bits(blocks[..., 4:8]) << 4)
    head = torch.cat([_f16(blocks, 0), _f16(blocks, 2)], dim=-1).contiguous()
    out = torch.cat([head.view(torch.uint8), q.to(torch.uint8)], dim=2)
    return out.reshape(raw.shape[0], -1)


def iq4_nl_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """IQ4_NL blocks [rows, nb * 18] (d, 16 bytes of nibbles indexing IQ4_NL_LEVELS) as Q8_0
    blocks (d, the levels as int8): the same values."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.int8)
    codes = levels[_nibbles(blocks[..., 2:]).long()].view(torch.uint8)
    return torch.cat([blocks[..., 0:2], codes], dim=2).reshape(raw.shape[0], -1)


def mxfp4_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents uint8 [...] -> 2^(e - 128) float32 (ggml_e8m0_to_fp32_half's bits: e 0
    and 1 are float32 subnormals)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def mxfp4_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks uint8 [..., 17] -> (scale float32 [..., 1], exact; levels int8 [..., 32]
    in -12..12): weight i is scale * level[i]."""
    levels = torch.tensor(MXFP4_LEVELS, dtype=torch.int8)
    return mxfp4_scale(blocks[..., 0:1]), levels[_nibbles(blocks[..., 1:]).long()]


def _fp16_exponents(blocks: torch.Tensor) -> bool:
    """Whether every MXFP4 block's [..., 17] exponent is in MXFP4_FP16_EXPONENTS."""
    exponents = blocks[..., 0]
    return bool(((exponents >= MXFP4_FP16_EXPONENTS.start)
                 & (exponents < MXFP4_FP16_EXPONENTS.stop)).all())


def mxfp4_as_tile_blocks(raw: torch.Tensor) -> tuple[int, torch.Tensor]:
    """MXFP4 blocks [rows, nb * 17] as blocks of a tile type holding the same values, their
    doubled e2m1 levels as int8 codes: Q8_0 [rows, nb * 34] (fp16 d = 2^(e - 128)) where
    every exponent is in MXFP4_FP16_EXPONENTS (gguf-py's quantizer writes those for blocks
    whose largest |w| lies in [2^-21, 2^19)), else Q6_K [rows, nb * 40] (both 16-column
    halves the float32 scale, exact for every e)."""
    blocks = raw.reshape(raw.shape[0], -1, 17)
    scale, levels = mxfp4_parts(blocks)
    fp16 = _fp16_exponents(blocks)
    head = scale.half().view(torch.uint8) if fp16 else scale.repeat(1, 1, 2).view(torch.uint8)
    out = torch.cat([head, levels.view(torch.uint8)], dim=2).reshape(raw.shape[0], -1)
    return (Q8_0 if fp16 else Q6_K), out


def mxfp4_as_level_blocks(raw: torch.Tensor) -> torch.Tensor | None:
    """MXFP4 blocks [rows, nb * 17] as level tiles' blocks [rows, nb * 18] (IQ4_NL's form:
    fp16 d = 2^(e - 128), then the file's 16 bytes of nibbles, which index MXFP4_LEVELS), or
    None where an exponent lies outside MXFP4_FP16_EXPONENTS."""
    blocks = raw.reshape(raw.shape[0], -1, 17)
    if not _fp16_exponents(blocks):
        return None
    head = mxfp4_scale(blocks[..., 0:1]).half().view(torch.uint8)
    return torch.cat([head, blocks[..., 1:]], dim=2).reshape(raw.shape[0], -1)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes [n, 12] -> eight 6-bit scales and eight mins, uint8 [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K superblocks uint8 [n, 144] (fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and
    eight 6-bit mins, 128 bytes of nibbles) -> (scale, minimum: float32 [n, 8], exact;
    quants uint8 [n, 8, 32]): weight i of sub-block j is scale[j] * q[j, i] + minimum[j]."""
    n = blocks.shape[0]
    sc, mn = _k4_scales(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)        # 32 bytes: sub-block 2g low, 2g + 1 high
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    return _f16(blocks, 0) * sc.float(), -_f16(blocks, 2) * mn.float(), q


def q5_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K superblocks uint8 [n, 176] (Q4_K's first 16 bytes, 32 bytes of fifth bits, 128 of
    nibbles) -> as q4_k_parts, quants in 0..31: sub-block j's fifth bits are bit j of those
    32 bytes."""
    n = blocks.shape[0]
    sc, mn = _k4_scales(blocks[:, 4:16])
    qs = blocks[:, 48:].reshape(n, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    high = (blocks[:, None, 16:48] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return _f16(blocks, 0) * sc.float(), -_f16(blocks, 2) * mn.float(), low | (high << 4)


def q2_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q2_K superblocks uint8 [n, 84] (16 bytes of 4-bit scale and 4-bit minimum per 16
    weights, 64 bytes of bit pairs, fp16 d, fp16 dmin) -> (scale, minimum: float32 [n, 16],
    exact; quants uint8 [n, 16, 16] in 0..3): weight i of sub-block j is scale[j] * q[j, i] +
    minimum[j]."""
    n = blocks.shape[0]
    s = blocks[:, :16]
    pairs = blocks[:, 16:80].reshape(n, 2, 1, 32)                             # [n, half, 1, l]
    q = torch.cat([(pairs >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2)   # [n, 2, 4, 32]
    return (_f16(blocks, 80) * (s & 0x0F).float(), -_f16(blocks, 82) * (s >> 4).float(),
            q.reshape(n, 16, 16))


def q3_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K superblocks uint8 [n, 110] (32 bytes of high bits, 64 of bit pairs, 12 bytes of
    sixteen 6-bit scales stored + 32, fp16 d) -> (scale float32 [n, 16], exact; quants int8
    [n, 16, 16] in -4..3): weight i of sub-block j is scale[j] * q[j, i]."""
    n = blocks.shape[0]
    s = blocks[:, 96:108]
    low = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=1)                # [n, 16]
    high = torch.cat([(s[:, 8:12] >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=1)
    scale = _f16(blocks, 108) * ((low | (high << 4)).float() - 32)
    pairs = blocks[:, 32:96].reshape(n, 2, 1, 32)                             # [n, half, 1, l]
    q = torch.cat([(pairs >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2)   # [n, 2, 4, 32]
    bit = torch.arange(8, dtype=torch.uint8).reshape(2, 4, 1)                 # 4 half + step
    high_bit = (blocks[:, None, None, :32] >> bit) & 1
    values = q.to(torch.int8) - 4 * (1 - high_bit.to(torch.int8))
    return scale, values.reshape(n, 16, 16)


def _iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS superblocks uint8 [n, 136] (fp16 d, 16 bits of high scale bits, 4 bytes of low
    nibbles, 128 bytes of nibbles) -> each 32-weight block's 6-bit scale minus 32, int16
    [n, 8]: block j's weights are d * that * IQ4_NL_LEVELS[nibble]."""
    high = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32)           # [n, 1]
    low = blocks[:, 4:8].to(torch.int32)
    j = torch.arange(8)
    scale = ((low[:, j // 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 0x03) << 4)
    return (scale - 32).to(torch.int16)


def iq4_xs_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS superblocks uint8 [n, 136] -> (scale float32 [n, 8], exact; levels int8
    [n, 8, 32]): weight i of block j is scale[j] * level[j, i]."""
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.int8)
    q = _nibbles(blocks[:, 8:].reshape(-1, 8, 16)).long()                        # [n, 8, 32]
    return _f16(blocks, 0) * _iq4_xs_scales(blocks).float(), levels[q]


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


# A K-quant's superblock tile type (pagewire's ids, csrc/pagewire_api.h PwTile: the GGML id
# + 50; Q3_K's values take Q6_K's form) and its classic tile type (float32 scales a block).
# (IQ4_XS's: its int8 levels, which take Q6_K's form but not its six-bit range)
Q2_KS, Q4_KS, Q5_KS, Q6_KS, IQ4_XSS = 60, 62, 63, 64, 73
# IQ4_XS's superblocks as level tiles (its nibbles as stored, one scale a block): what
# kernels/quant.py packs IQ4_XSS blocks as where the library has them (iq4_xs_level_parts)
IQ4_XSL = 74
# Q6_K's superblocks (and Q3_K's, in Q6_K's form) as bit planes: the codes' low nibbles and
# high crumbs, the file's 6.56 bits a weight (kernels/quant.py _plane_bytes); the same parts
# as Q6_KS's, which kernels/quant.py packs so for int8 activations where the library has them
Q6_KP = 75
# Q5_K's superblocks likewise: the codes' low nibbles and fifth bits (the file's 5.5 bits a
# weight; kernels/quant.py _fifth_bit_bytes), Q5_KS's parts
Q5_KP = 76
SUPER = {Q2_K: Q2_KS, Q3_K: Q6_KS, Q4_K: Q4_KS, Q5_K: Q5_KS, Q6_K: Q6_KS, IQ4_XS: IQ4_XSS}
CLASSIC = {Q2_KS: Q2_K, Q4_KS: Q4_K, Q5_KS: Q5_K, Q6_KS: Q6_K, IQ4_XSS: Q6_K}
# a superblock tile type's (fp16 heads, int8 scale arrays, quant bytes) a 32-weight block
SUPER_PARTS = {Q2_KS: (2, 4, 32), Q4_KS: (2, 2, 16), Q5_KS: (2, 2, 32), Q6_KS: (1, 2, 32),
               IQ4_XSS: (1, 2, 32), IQ4_XSL: (1, 1, 16)}
# IQ4_NL's levels' indices: byte (level & 0xFF) -> its nibble (iq4_xs_level_parts)
_IQ4_NL_INDEX = torch.zeros(256, dtype=torch.uint8)
_IQ4_NL_INDEX[torch.tensor(IQ4_NL_LEVELS, dtype=torch.int8).view(torch.uint8).long()] = \
    torch.arange(16, dtype=torch.uint8)


def iq4_xs_level_parts(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """IQ4_XSS blocks' parts (super_parts: heads, two equal scale bytes, 32 int8 levels) as
    IQ4_XSL's: the same heads, one scale byte, the levels' nibbles as the file stores them
    (byte i: weights i and i + 16)."""
    heads, scales, levels = parts
    index = _IQ4_NL_INDEX[levels.long()]                                    # [rows, nb, 32]
    return heads, scales[..., :1], index[..., :16] | (index[..., 16:] << 4)


def _scale_bytes(ggml_type: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-quant's (or IQ4_XS's) superblocks [n, bytes] -> (fp16 heads [n, H]: d, and -dmin
    where the type has minimums; int8 [n, 8, arrays]: each 32-weight block's sub-block scales (two for the
    types of 16-weight sub-blocks), then its minimums) with weight = head * byte * q (+ the
    minimum's head * byte): the stored integers, unscaled."""
    n = blocks.shape[0]
    if ggml_type in (Q4_K, Q5_K):
        sc, mn = _k4_scales(blocks[:, 4:16])
        heads, scales = blocks[:, 0:4], torch.stack([sc, mn], dim=-1)          # [n, 8, 2]
    elif ggml_type == Q2_K:
        s = blocks[:, :16].reshape(n, 8, 2)
        heads, scales = blocks[:, 80:84], torch.cat([s & 0x0F, s >> 4], dim=-1)
    elif ggml_type == IQ4_XS:   # one scale a block: both 16-column halves take it
        heads, scales = blocks[:, 0:2], _iq4_xs_scales(blocks).to(torch.int8)[..., None].repeat(
            1, 1, 2)
    elif ggml_type == Q3_K:
        s = blocks[:, 96:108]
        low = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=1)              # [n, 16]
        high = torch.cat([(s[:, 8:12] >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=1)
        heads = blocks[:, 108:110]
        scales = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, 8, 2)
    else:                                                                        # Q6_K
        heads, scales = blocks[:, 208:210], blocks[:, 192:208].reshape(n, 8, 2)
    heads = heads.contiguous().view(torch.float16).clone()
    if heads.shape[1] == 2:
        heads[:, 1] = -heads[:, 1]            # the minimum's head: -dmin (exact in fp16)
    return heads, scales.contiguous().view(torch.int8)


def _tile_quants(ggml_type: int, blocks: torch.Tensor) -> torch.Tensor:
    """A K-quant's superblocks [n, bytes] -> each 32-weight block's quants as its tile type
    holds them, uint8 [n, 8, 16 or 32]: Q4_K's nibbles in Q4_1's order (weights 0-15 low,
    16-31 high), the others a byte a weight (Q3_K and Q6_K int8; IQ4_XS its int8 levels)."""
    if ggml_type in (Q4_K, Q5_K):
        q = (q4_k_parts if ggml_type == Q4_K else q5_k_parts)(blocks)[2]
        return q[..., :16] | (q[..., 16:] << 4) if ggml_type == Q4_K else q
    if ggml_type == Q2_K:
        return q2_k_parts(blocks)[2].reshape(-1, 8, 32)
    if ggml_type == IQ4_XS:
        return iq4_xs_parts(blocks)[1].view(torch.uint8)
    q = (q3_k_parts if ggml_type == Q3_K else q6_k_parts)(blocks)[1]
    return q.reshape(-1, 8, 32).view(torch.uint8)


def k_quant_super_blocks(ggml_type: int, raw: torch.Tensor) -> tuple[int, torch.Tensor]:
    """A K-quant (or IQ4_XS) tensor's superblocks uint8 [rows, cols / 256 * bytes] as 32-weight
    blocks of its superblock tile type (SUPER), which ranks can share by whole blocks: (type, uint8
    [rows, cols / 32 * block bytes]), a block its superblock's fp16 heads (repeated in each of
    its 8 blocks), its int8 scale bytes, then its quants (_tile_quants). kernels/quant.py
    packs 8 blocks of one superblock as one tile (or, cut apart, as classic tiles)."""
    if ggml_type not in SUPERBLOCKS:
        raise ValueError(f"GGML type {ggml_type} is not a K-quant")
    rows, superblocks = raw.shape[0], raw.reshape(-1, SUPERBLOCKS[ggml_type])
    heads, scales = _scale_bytes(ggml_type, superblocks)
    heads = heads[:, None, :].expand(-1, 8, -1).contiguous().view(torch.uint8)   # [n, 8, 2H]
    parts = [heads, scales.view(torch.uint8), _tile_quants(ggml_type, superblocks)]
    return SUPER[ggml_type], torch.cat(parts, dim=-1).reshape(rows, -1)


def super_parts(super_type: int, raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Superblock tile blocks [rows, nb * bytes] -> (heads fp16 [rows, nb, H], scale bytes
    int8 [rows, nb, arrays], quants uint8 [rows, nb, 16 or 32]): k_quant_super_blocks' parts."""
    heads, arrays, quants = SUPER_PARTS[super_type]
    blocks = raw.reshape(raw.shape[0], -1, 2 * heads + arrays + quants)
    return (blocks[..., :2 * heads].contiguous().view(torch.float16),
            blocks[..., 2 * heads:2 * heads + arrays].contiguous().view(torch.int8),
            blocks[..., 2 * heads + arrays:])


def super_as_classic(super_type: int, raw: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Superblock tile blocks as blocks of the classic tile type of the same values: each
    scale array a float32 (head * byte, exact) before the quants."""
    heads, scales, quants = super_parts(super_type, raw)
    splits = 1 if super_type in (Q4_KS, Q5_KS) else 2
    head_of = [min(a // splits, heads.shape[-1] - 1) for a in range(scales.shape[-1])]
    floats = heads.float()[..., head_of] * scales.float()                  # [rows, nb, arrays]
    blocks = torch.cat([floats.contiguous().view(torch.uint8), quants], dim=-1)
    return CLASSIC[super_type], blocks.reshape(raw.shape[0], -1)


def k_quant_blocks(ggml_type: int, raw: torch.Tensor) -> tuple[int, torch.Tensor]:
    """A K-quant tensor's superblocks uint8 [rows, cols / 256 * bytes] as 32-weight blocks of
    a classic tile type holding the same values: (tile type, uint8 [rows, cols / 32 * its
    bytes]). Q4_K, Q5_K: (scale, minimum) float32, then the sub-block's nibbles in Q4_1's
    order (weights 0-15 low, 16-31 high; Q4_K) or bytes (Q5_K); Q3_K and Q6_K as Q6_K: the
    two 16-weight sub-blocks' scales float32, then 32 int8; Q2_K: their two scales and two
    minimums float32, then 32 bytes."""
    return super_as_classic(*k_quant_super_blocks(ggml_type, raw))


# Types whose 32-weight blocks become blocks of a tile type holding the same values.
AS_TILE_BLOCKS = {Q4_0: lambda raw: (Q4_1, q4_0_as_q4_1(raw)),
                  Q5_0: lambda raw: (Q8_0, q5_0_as_q8_0(raw)),
                  Q5_1: lambda raw: (Q5_K, q5_1_as_q5_k(raw)),
                  IQ4_NL: lambda raw: (Q8_0, iq4_nl_as_q8_0(raw)),
                  MXFP4: mxfp4_as_tile_blocks}
