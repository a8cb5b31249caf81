"""Level tiles (csrc/quant_tiles.h Levels): IQ4_NL's, MXFP4's and IQ4_XS's nibbles kept as
the file stores them, indexing their codebooks in the kernels of every tier (Q8_0 tiles of
the same values, IQ4_XS int8 superblock tiles, where a library lacks them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.kernels import gguf_blocks, quant
from pagewire.kernels.ops import CpuOps
from pagewire.testing.gguf_writer import random_blocks
from tests.kernels.test_gguf_blocks import dequantized

pytest.importorskip("gguf")
LEVEL = {"IQ4_NL": quant.IQ4_NL, "MXFP4": quant.MXFP4}
OFFSET = {"exact": 0, "int8": 100, "int16": 200}


def level_raw(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random blocks of `qtype`, MXFP4's exponents inside fp16's range (its level tiles')."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, rows, cols, rng)
    if qtype == "MXFP4":
        raw.view(rows, cols // 32, 17)[..., 0] = torch.from_numpy(
            rng.integers(118, 132, (rows, cols // 32), dtype=np.uint8))
    return raw


def as_q8_0(qtype: str, raw: torch.Tensor) -> torch.Tensor:
    """The same values as Q8_0 blocks (what the avx512_bf16 tier packs: AS_TILE_BLOCKS)."""
    kind, blocks = gguf_blocks.AS_TILE_BLOCKS[LEVEL[qtype]](raw)
    assert kind == quant.Q8_0
    return blocks


@pytest.mark.parametrize("qtype", sorted(LEVEL))
@pytest.mark.parametrize("rounding", sorted(OFFSET))
def test_level_blocks_pack_as_level_tiles_where_the_library_has_them(native_lib, qtype,
                                                                     rounding):
    raw = level_raw(qtype, 32, 256, 0)
    weight = quant.pack(LEVEL[qtype], raw, 256, native_lib, rounding)
    kind = LEVEL[qtype] + OFFSET[rounding]
    assert native_lib.quant_kind(kind)
    assert kind in CpuOps(native_lib).capabilities.block_kinds
    # 16 rows x 32 columns: 256 bytes of nibbles and 16 fp16 d, 4.5 bits a weight
    assert weight.kind == kind and weight.nbytes == 32 * 256 // 32 * 18


def test_level_tile_layout(native_lib):
    """Exact: byte [k][l] is the file's byte k of row l (columns k and k + 16); integer
    activations: byte [j][w][p] holds columns 4j + p (low) and 4j + 2 + p (high) of row
    (0-3, 8-11, 4-7, 12-15)[w]; then d [16] fp16."""
    raw = level_raw("IQ4_NL", 16, 32, 1)                           # [16 rows, 18 bytes]
    exact = quant.pack(quant.IQ4_NL, raw, 32, native_lib).tiles[0, 0]
    steps = quant.pack(quant.IQ4_NL, raw, 32, native_lib, "int8").tiles[0, 0]
    assert exact.shape == steps.shape == (288,)
    order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    for row in range(16):
        assert exact[256 + 2 * row: 258 + 2 * row].tolist() == raw[row, 0:2].tolist()
        assert steps[256 + 2 * row: 258 + 2 * row].tolist() == raw[row, 0:2].tolist()
        assert [int(exact[16 * k + row]) for k in range(16)] == raw[row, 2:].tolist()
        qs = raw[row, 2:].tolist()
        column = [b & 15 for b in qs] + [b >> 4 for b in qs]       # the 32 indices
        w = order.index(row)
        for j in range(8):
            for p in range(2):
                byte = int(steps[32 * j + 2 * w + p])
                assert (byte & 15, byte >> 4) == (column[4 * j + p], column[4 * j + 2 + p])


@pytest.mark.parametrize("qtype", sorted(LEVEL))
@pytest.mark.parametrize("rounding", ["int8", "int16"])
@pytest.mark.parametrize("tokens", [1, 3, 5, 16, 40])   # the small kernels, then the GEMMs
def test_level_tiles_multiply_as_the_q8_0_tiles_of_their_values(native_lib, qtype, rounding,
                                                                tokens):
    """Integer activations: bit for bit what the Q8_0 tiles of the same values give, in the
    small kernels and the GEMMs (the same integer sums, the same scales)."""
    raw = level_raw(qtype, 48, 320, tokens)
    levels = quant.pack(LEVEL[qtype], raw, 320, native_lib, rounding)
    q8 = quant.pack(quant.Q8_0, as_q8_0(qtype, raw), 320, native_lib, rounding)
    rng = np.random.default_rng(tokens)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.standard_normal((tokens, 320)).astype(np.float32)).to(dtype)
        assert torch.equal(quant.matmul(x, levels), quant.matmul(x, q8))


@pytest.mark.parametrize("qtype", sorted(LEVEL))
@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_level_tiles_exact_products_equal_the_dequantized_weights(native_lib, qtype, tokens):
    """float32 activations: within float32 rounding of the float64 product (the level tiles
    sum columns k and k + 16 where Q8_0's sum 2i and 2i + 1: not bit for bit)."""
    raw = level_raw(qtype, 32, 256, 7)
    w = torch.from_numpy(dequantized(raw, qtype)).double()
    x = torch.from_numpy(np.random.default_rng(tokens).standard_normal(
        (tokens, 256)).astype(np.float32))
    out = quant.matmul(x, quant.pack(LEVEL[qtype], raw, 256, native_lib))
    bound = (x.double().abs() @ w.abs().T) * 256 * 2.0 ** -24
    assert ((out.double() - x.double() @ w.T).abs() <= bound).all()


def test_iq4_xs_whole_superblocks_take_level_tiles_and_a_cut_share_classic_ones(native_lib):
    """IQ4_XS's superblocks (the loader's IQ4_XSS blocks) pack as IQ4_XSL level tiles,
    2208 bytes a 16 x 256; a rank's share starting inside a superblock
    as the classic tiles (Q6_K's float32 scales) of the same values."""
    raw = random_blocks("IQ4_XS", 16, 512, np.random.default_rng(6))
    values = torch.from_numpy(dequantized(raw, "IQ4_XS")).double()
    _, blocks = gguf_blocks.k_quant_super_blocks(gguf_blocks.IQ4_XS, raw)
    whole = quant.pack(quant.IQ4_XSS, blocks, 512, native_lib)
    assert whole.kind == quant.IQ4_XSL and whole.nbytes == 2 * 2208
    per_block = blocks.shape[1] // 16
    cut = quant.pack(quant.IQ4_XSS, blocks[:, 4 * per_block:12 * per_block], 256, native_lib)
    assert cut.kind == quant.Q6_K
    x = torch.randn(3, 512)
    for weight, cols in ((whole, slice(0, 512)), (cut, slice(128, 384))):
        xs = x[:, cols].contiguous()
        w = values[:, cols]
        bound = (xs.double().abs() @ w.abs().T) * 512 * 2.0 ** -24
        assert ((quant.matmul(xs, weight).double() - xs.double() @ w.T).abs() <= bound).all()
