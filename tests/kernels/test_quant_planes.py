"""Q6_K's bit planes (csrc/quant_tiles.h Q6_KP): the six-bit codes of Q6_K's superblocks (and
Q3_K's, in Q6_K's form) kept as low nibbles and high crumbs, the file's 26.25 bytes a 32
weights, on the avx512_bf16 tier; every other tier, and the int16 rounding, keeps Q6_KS's
int8 codes (34.25)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.kernels import gguf_blocks, native, quant, tiers
from pagewire.testing.gguf_writer import random_blocks
from tests.kernels.test_gguf_blocks import dequantized

pytest.importorskip("gguf")
K_QUANTS = {"Q6_K": gguf_blocks.Q6_K, "Q3_K": gguf_blocks.Q3_K}
OFFSET = {"exact": 0, "int8": 100, "int16": 200}


def super_blocks(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random `qtype` superblocks as the loader's Q6_KS blocks."""
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    kind, blocks = gguf_blocks.k_quant_super_blocks(K_QUANTS[qtype], raw)
    assert kind == quant.Q6_KS
    return blocks


@pytest.mark.parametrize("qtype", sorted(K_QUANTS))
@pytest.mark.parametrize("rounding", sorted(OFFSET))
def test_whole_superblocks_pack_as_planes_where_the_tier_has_them(native_lib, qtype, rounding):
    weight = quant.pack(quant.Q6_KS, super_blocks(qtype, 32, 512, 0), 512, native_lib, rounding)
    planes = native_lib.tier == "avx512_bf16" and rounding != "int16"
    assert native_lib.quant_kind(quant.Q6_KP + OFFSET[rounding]) == planes
    assert weight.kind == (quant.Q6_KP if planes else quant.Q6_KS) + OFFSET[rounding]
    # 16 x 256: 8 blocks of 384 bytes of planes (or 512 of codes), 256 scale bytes, 16 fp16 d
    assert weight.nbytes == 2 * 2 * (3360 if planes else 4384)


def test_a_cut_superblock_keeps_the_classic_tiles(native_lib):
    """A rank's share starting inside a superblock: Q6_K's classic tiles (float32 scales)."""
    blocks = super_blocks("Q6_K", 16, 512, 1)
    per_block = blocks.shape[1] // 16
    cut = quant.pack(quant.Q6_KS, blocks[:, 4 * per_block:12 * per_block], 256, native_lib)
    assert cut.kind == quant.Q6_K


def plane_codes(tiles: torch.Tensor, rounding: str) -> torch.Tensor:
    """The codes [16 rows, 32 columns] of one block's 384 bytes, read back as the kernels'
    comments say they lie."""
    nibbles, crumbs = tiles[:256].long(), tiles[256:].long()
    q = torch.zeros(16, 32, dtype=torch.long)
    for row in range(16):
        for col in range(32):
            if rounding == "exact":          # step s, byte 2 row + c; crumbs XOR 2
                half, s, c = col // 16, col % 16 // 2, col % 2
                byte = nibbles[32 * s + 2 * row + c]
                crumb = crumbs[32 * (s // 2) + 2 * row + c] >> (2 * half + 4 * (s % 2)) & 3
                q[row, col] = (byte >> 4 * half & 15) | (crumb ^ 2) << 4
            else:                            # pair p, byte 4 row + c; crumbs of k and k + 32
                p, half, c = col // 8, col % 8 // 4, col % 4
                byte = nibbles[64 * p + 4 * row + c]
                crumb = crumbs[32 * p + 4 * (row % 8) + c] >> (2 * (row // 8) + 4 * half) & 3
                q[row, col] = (byte >> 4 * half & 15) | crumb << 4
    return q - 32


@pytest.mark.parametrize("rounding", ["exact", "int8"])
def test_plane_layout(native_lib, rounding):
    if native_lib.tier != "avx512_bf16":
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    blocks = super_blocks("Q6_K", 16, 256, 2)
    codes = gguf_blocks.super_parts(quant.Q6_KS, blocks)[2].view(torch.int8)   # [16, 8, 32]
    tiles = quant.pack(quant.Q6_KS, blocks, 256, native_lib, rounding).tiles[0, 0]
    assert tiles.shape == (3360,)
    for b in range(8):
        assert torch.equal(plane_codes(tiles[384 * b:384 * (b + 1)], rounding),
                           codes[:, b].long())


@pytest.mark.parametrize("qtype", sorted(K_QUANTS))
@pytest.mark.parametrize("rounding", ["exact", "int8"])
@pytest.mark.parametrize("tokens", [1, 3, 7, 8, 40])    # the small kernels, then the GEMMs
def test_planes_multiply_as_the_q6_ks_tiles_of_their_codes(native_lib, qtype, rounding,
                                                          tokens):
    """Bit for bit what Q6_KS tiles give: the same bfloat16 pairs in the same chains (exact),
    the same integer sums and scales (int8)."""
    if native_lib.tier != "avx512_bf16":
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    blocks = super_blocks(qtype, 48, 512, tokens)
    planes = quant.pack(quant.Q6_KS, blocks, 512, native_lib, rounding)
    assert planes.kind == quant.Q6_KP + OFFSET[rounding]
    codes = quant.pack(quant.Q6_KS, blocks, 512, native_lib, rounding, planes=False)
    assert codes.kind == quant.Q6_KS + OFFSET[rounding]
    rng = np.random.default_rng(tokens)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.standard_normal((tokens, 512)).astype(np.float32)).to(dtype)
        assert torch.equal(quant.matmul(x, planes), quant.matmul(x, codes))


def test_planes_exact_products_equal_the_dequantized_weights(native_lib):
    """float32 activations: within float32 rounding of gguf-py's values' float64 product."""
    raw = random_blocks("Q6_K", 32, 512, np.random.default_rng(3))
    _, blocks = gguf_blocks.k_quant_super_blocks(gguf_blocks.Q6_K, raw)
    w = torch.from_numpy(dequantized(raw, "Q6_K")).double()
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32))
    out = quant.matmul(x, quant.pack(quant.Q6_KS, blocks, 512, native_lib))
    bound = (x.double().abs() @ w.abs().T) * 512 * 2.0 ** -24
    assert ((out.double() - x.double() @ w.T).abs() <= bound).all()


def test_a_library_without_planes_refuses_them(native_lib):
    """Tiles of a kind the library has no kernel for raise, not crash (a null kernel)."""
    if "avx512_bf16" not in tiers.runnable():
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    planes = quant.pack(quant.Q6_KS, super_blocks("Q6_K", 16, 256, 5), 256,
                        native.load("avx512_bf16"))
    assert planes.kind == quant.Q6_KP
    if native_lib.tier == "avx512_bf16":
        assert quant.QuantWeight(planes.segments, 256, native_lib).kind == quant.Q6_KP
    else:
        with pytest.raises(ValueError, match=rf"{native_lib.tier} kernels multiply no tiles "
                                             rf"of kind \[75\]"):
            quant.QuantWeight(planes.segments, 256, native_lib)
