"""GGUF blocks as the tiles' blocks (kernels/gguf_blocks.py): every type the matmuls take
becomes blocks of a tile type holding exactly the values gguf-py's dequantization gives,
from blocks of random bytes (every bit pattern of quants, scales and minimums)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.kernels import gguf_blocks as gb
from pagewire.testing.gguf_writer import random_blocks

gguf = pytest.importorskip("gguf")
CONVERTED = ["Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
             "MXFP4"]
def dequantized(raw: torch.Tensor, qtype: str) -> np.ndarray:
    """gguf-py's values of the file's blocks, float32 [rows, cols]."""
    kind = gguf.GGMLQuantizationType[qtype]
    return np.asarray(gguf.quants.dequantize(raw.numpy(), kind), dtype=np.float32)


def as_tile_blocks(qtype: str, raw: torch.Tensor) -> tuple[int, torch.Tensor]:
    kind = int(gguf.GGMLQuantizationType[qtype])
    if kind in gb.SUPERBLOCKS:
        return gb.k_quant_blocks(kind, raw)
    return gb.AS_TILE_BLOCKS[kind](raw)


def tile_block_values(tile: int, raw: torch.Tensor) -> torch.Tensor:
    """A tile type's 32-weight blocks [rows, bytes] read back: float32 [rows, cols]."""
    rows = raw.shape[0]
    if tile in (gb.Q4_1, gb.Q8_0):             # the file's own formats: gguf-py reads them
        return torch.from_numpy(dequantized(raw, "Q4_1" if tile == gb.Q4_1 else "Q8_0"))
    b = raw.reshape(rows, -1, {gb.Q4_K: 24, gb.Q5_K: 40, gb.Q6_K: 40, gb.Q2_K: 48}[tile])
    if tile == gb.Q2_K:                          # d, d, m, m of columns 0-15 and 16-31
        head = b[..., :16].contiguous().view(torch.float32).reshape(rows, -1, 2, 2, 1)
        q = b[..., 16:].float().reshape(rows, -1, 2, 16)
        return (head[:, :, 0] * q + head[:, :, 1]).reshape(rows, -1)
    head = b[..., :8].contiguous().view(torch.float32)                    # [rows, nb, 2]
    if tile == gb.Q6_K:
        q = b[..., 8:].view(torch.int8).float().reshape(rows, -1, 2, 16)
        return (head[..., None] * q).reshape(rows, -1)
    q = torch.cat([b[..., 8:] & 0x0F, b[..., 8:] >> 4], -1) if tile == gb.Q4_K else b[..., 8:]
    return (head[..., :1] * q.float() + head[..., 1:]).reshape(rows, -1)


@pytest.mark.parametrize("qtype", CONVERTED)
def test_blocks_become_a_tile_types_blocks_of_the_same_values(qtype):
    raw = random_blocks(qtype, 3, 512, np.random.default_rng(len(qtype)))
    tile, blocks = as_tile_blocks(qtype, raw)
    expected = {"Q4_0": gb.Q4_1, "Q5_0": gb.Q8_0, "Q5_1": gb.Q5_K, "IQ4_NL": gb.Q8_0,
                "Q2_K": gb.Q2_K, "Q3_K": gb.Q6_K, "Q4_K": gb.Q4_K, "Q5_K": gb.Q5_K,
                "Q6_K": gb.Q6_K, "IQ4_XS": gb.Q6_K, "MXFP4": gb.Q8_0}[qtype]
    assert tile == expected
    assert torch.equal(tile_block_values(tile, blocks), torch.from_numpy(dequantized(raw, qtype)))


def test_mxfp4_of_every_exponent_becomes_q6_k_blocks_of_the_same_values():
    """Exponents fp16 cannot hold as 2^(e - 128) (below 104, from 144; 0 and 1 float32
    subnormals) take Q6_K's float32 scales, bit for bit gguf-py's values; a tensor whose
    exponents all fit keeps Q8_0's fp16 d, the scale exactly."""
    raw = torch.arange(256 * 17, dtype=torch.int64).remainder(251).to(torch.uint8)
    raw = raw.reshape(8, 32 * 17)
    raw.view(8, 32, 17)[..., 0] = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    tile, blocks = gb.mxfp4_as_tile_blocks(raw)
    assert tile == gb.Q6_K and blocks.shape == (8, 32 * 40)
    ours = tile_block_values(tile, blocks).numpy()
    with np.errstate(over="ignore"):           # 12 * 2^127: inf, in gguf-py as in ggml
        theirs = dequantized(raw, "MXFP4")
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    inside = raw.view(8, 32, 17)[:, :5].clone()                      # exponents 104..143
    inside[..., 0] = torch.arange(104, 144, dtype=torch.uint8).reshape(8, 5)
    tile, blocks = gb.mxfp4_as_tile_blocks(inside.reshape(8, -1))
    assert tile == gb.Q8_0
    assert torch.equal(tile_block_values(tile, blocks),
                       torch.from_numpy(dequantized(inside.reshape(8, -1), "MXFP4")))
    assert torch.equal(gb.mxfp4_scale(torch.tensor([104, 128, 143], dtype=torch.uint8)),
                       torch.tensor([2.0 ** -24, 1.0, 2.0 ** 15]))


def test_k_quants_from_known_parts():
    """Blocks packed of known scales, minimums and quants (actors/testing/gguf_writer.py) give
    those weights exactly."""
    from pagewire.testing.gguf_writer import k_quant_from_parts
    for qtype, kind in (("Q4_K", gb.Q4_K), ("Q6_K", gb.Q6_K)):
        blocks, w = k_quant_from_parts(qtype, 6, np.random.default_rng(7))
        tile, raw = gb.k_quant_blocks(kind, torch.from_numpy(blocks.reshape(2, -1)))
        assert torch.equal(tile_block_values(tile, raw), torch.from_numpy(w.reshape(2, -1)))


def test_q4_0_keeps_its_nibbles_and_scale():
    """d * (q - 8) == d * q + m with m = -8 d, exact in fp16; nibbles untouched."""
    raw = random_blocks("Q4_0", 4, 64, np.random.default_rng(3))
    as_q4_1 = gb.q4_0_as_q4_1(raw)
    assert as_q4_1.shape == (4, 40)
    blocks = as_q4_1.reshape(4, 2, 20)
    assert torch.equal(blocks[..., 4:], raw.reshape(4, 2, 18)[..., 2:])
    assert torch.equal(blocks[..., :2], raw.reshape(4, 2, 18)[..., :2])


def test_the_writers_iq4_nl_is_near_the_weights():
    """d = max |w| / 127: a value is at most half the widest gap between levels (24) from
    one, or 127 - 113 = 14 units above the top level (a block's largest positive value)."""
    from pagewire.testing.gguf_writer import quantize_iq4_nl
    w = np.random.default_rng(5).standard_normal((2, 64)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_iq4_nl(w), gguf.GGMLQuantizationType.IQ4_NL)
    block_max = np.abs(w.reshape(2, 2, 32)).max(-1, keepdims=True)
    assert (np.abs(back - w).reshape(2, 2, 32) <= block_max / 127 * 14 * 1.001).all()


def test_a_type_that_is_no_k_quant_is_refused():
    with pytest.raises(ValueError, match="not a K-quant"):
        gb.k_quant_blocks(gb.Q8_0, torch.zeros(1, 34, dtype=torch.uint8))
