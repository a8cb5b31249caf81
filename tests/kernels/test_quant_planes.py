"""Bit planes (csrc/quant_tiles.h Q6_KP, Q5_KP): the six-bit codes of Q6_K's superblocks (and
Q3_K's, in Q6_K's form) kept as low nibbles and high crumbs, the file's 26.25 bytes a 32
weights, and Q5_K's five-bit codes as nibbles and fifth bits (22.5, the file's 22), for int8
activations on the avx512_bf16 tier (VNNI); every other tier and rounding keeps Q6_KS's and
Q5_KS's int8 codes (34.25, 34.5)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.kernels import gguf_blocks, native, quant, tiers
from pagewire.testing.gguf_writer import random_blocks

pytest.importorskip("gguf")
# type: (GGML type, its superblock tile type, its plane type, bytes a 16 x 256 superblock as
# planes and as codes: 8 blocks of planes or of 512 bytes of codes, the scale bytes, fp16 heads)
K_QUANTS = {"Q6_K": (gguf_blocks.Q6_K, quant.Q6_KS, quant.Q6_KP, 3360, 4384),
            "Q3_K": (gguf_blocks.Q3_K, quant.Q6_KS, quant.Q6_KP, 3360, 4384),
            "Q5_K": (gguf_blocks.Q5_K, quant.Q5_KS, quant.Q5_KP, 2880, 4416)}
OFFSET = {"exact": 0, "int8": 100, "int16": 200}


def super_blocks(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random `qtype` superblocks as the loader's superblock tile blocks."""
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    kind, blocks = gguf_blocks.k_quant_super_blocks(K_QUANTS[qtype][0], raw)
    assert kind == K_QUANTS[qtype][1]
    return blocks


@pytest.mark.parametrize("qtype", sorted(K_QUANTS))
@pytest.mark.parametrize("rounding", sorted(OFFSET))
def test_whole_superblocks_pack_as_planes_where_the_tier_has_them(native_lib, qtype, rounding):
    _, codes_type, plane_type, plane_bytes, code_bytes = K_QUANTS[qtype]
    weight = quant.pack(codes_type, super_blocks(qtype, 32, 512, 0), 512, native_lib, rounding)
    planes = native_lib.tier == "avx512_bf16" and rounding == "int8"
    assert native_lib.quant_kind(plane_type + OFFSET[rounding]) == planes
    assert weight.kind == (plane_type if planes else codes_type) + OFFSET[rounding]
    assert weight.nbytes == 2 * 2 * (plane_bytes if planes else code_bytes)


def test_a_cut_superblock_keeps_the_classic_tiles(native_lib):
    """A rank's share starting inside a superblock: Q6_K's classic tiles (float32 scales)."""
    blocks = super_blocks("Q6_K", 16, 512, 1)
    per_block = blocks.shape[1] // 16
    cut = quant.pack(quant.Q6_KS, blocks[:, 4 * per_block:12 * per_block], 256, native_lib,
                     "int8")
    assert cut.kind == quant.Q6_K + 100


def plane_codes(tiles: torch.Tensor) -> torch.Tensor:
    """The codes [16 rows, 32 columns] of one block's 384 bytes, read back as
    csrc/quant_step_vnni.h plane_operands says they lie: steps 2p, 2p + 1 in nibble byte
    4 row + c; the crumbs of nibble bytes k and k + 32 in crumb byte k."""
    nibbles, crumbs = tiles[:256].long(), tiles[256:].long()
    q = torch.zeros(16, 32, dtype=torch.long)
    for row in range(16):
        for col in range(32):
            p, half, c = col // 8, col % 8 // 4, col % 4
            byte = nibbles[64 * p + 4 * row + c]
            crumb = crumbs[32 * p + 4 * (row % 8) + c] >> (2 * (row // 8) + 4 * half) & 3
            q[row, col] = (byte >> 4 * half & 15) | crumb << 4
    return q - 32


def fifth_bit_codes(tiles: torch.Tensor) -> torch.Tensor:
    """The codes [16 rows, 32 columns] of one Q5_KP block's 320 bytes, as
    csrc/quant_step_vnni.h fifth_bit_operands says they lie: the nibbles as plane_codes'; a
    pair's 16 fifth-bit bytes two 64-bit masks (low nibbles', high ones'), bit n nibble
    byte n's."""
    nibbles, fifth = tiles[:256].long(), tiles[256:].long()
    q = torch.zeros(16, 32, dtype=torch.long)
    for row in range(16):
        for col in range(32):
            p, half, c = col // 8, col % 8 // 4, col % 4
            n = 4 * row + c
            bit = fifth[16 * p + 8 * half + n // 8] >> n % 8 & 1
            q[row, col] = (nibbles[64 * p + n] >> 4 * half & 15) | bit << 4
    return q


def test_fifth_bit_layout(native_lib):
    if native_lib.tier != "avx512_bf16":
        pytest.skip("bit planes are avx512_bf16's")
    blocks = super_blocks("Q5_K", 16, 256, 2)
    codes = gguf_blocks.super_parts(quant.Q5_KS, blocks)[2]                  # [16, 8, 32]
    tiles = quant.pack(quant.Q5_KS, blocks, 256, native_lib, "int8").tiles[0, 0]
    assert tiles.shape == (2880,)
    for b in range(8):
        assert torch.equal(fifth_bit_codes(tiles[320 * b:320 * (b + 1)]), codes[:, b].long())


def test_plane_layout(native_lib):
    if native_lib.tier != "avx512_bf16":
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    blocks = super_blocks("Q6_K", 16, 256, 2)
    codes = gguf_blocks.super_parts(quant.Q6_KS, blocks)[2].view(torch.int8)   # [16, 8, 32]
    tiles = quant.pack(quant.Q6_KS, blocks, 256, native_lib, "int8").tiles[0, 0]
    assert tiles.shape == (3360,)
    for b in range(8):
        assert torch.equal(plane_codes(tiles[384 * b:384 * (b + 1)]),
                           codes[:, b].long())


@pytest.mark.parametrize("qtype", sorted(K_QUANTS))
@pytest.mark.parametrize("tokens", [1, 3, 7, 8, 40])    # the small kernels, then the GEMM
def test_planes_multiply_as_the_tiles_of_their_codes(native_lib, qtype, tokens):
    """Bit for bit what Q6_KS (Q5_KS) tiles give: the same integer sums and scales."""
    if native_lib.tier != "avx512_bf16":
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    _, codes_type, plane_type, _, _ = K_QUANTS[qtype]
    blocks = super_blocks(qtype, 48, 512, tokens)
    planes = quant.pack(codes_type, blocks, 512, native_lib, "int8")
    assert planes.kind == plane_type + 100
    codes = quant.pack(codes_type, blocks, 512, native_lib, "int8", planes=False)
    assert codes.kind == codes_type + 100
    rng = np.random.default_rng(tokens)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.standard_normal((tokens, 512)).astype(np.float32)).to(dtype)
        assert torch.equal(quant.matmul(x, planes), quant.matmul(x, codes))


def test_a_library_without_planes_refuses_them(native_lib):
    """Tiles of a kind the library has no kernel for raise, not crash (a null kernel)."""
    if "avx512_bf16" not in tiers.runnable():
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    planes = quant.pack(quant.Q6_KS, super_blocks("Q6_K", 16, 256, 5), 256,
                        native.load("avx512_bf16"), "int8")
    assert planes.kind == quant.Q6_KP + 100
    if native_lib.tier == "avx512_bf16":
        assert quant.QuantWeight(planes.segments, 256, native_lib).kind == quant.Q6_KP + 100
    else:
        with pytest.raises(ValueError, match=rf"{native_lib.tier} kernels multiply no tiles "
                                             rf"of kind \[175\]"):
            quant.QuantWeight(planes.segments, 256, native_lib)
