"""Quantized matmuls on GGUF blocks (kernels/quant.py, csrc/quant_kernels.cpp and
quant_avx2.h): the tile layout byte for byte, and products against gguf-py's dequantization
of the same blocks, on every tier this CPU runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.kernels import gguf_blocks, quant
from pagewire.kernels.linear import Linear
from pagewire.kernels.ops import CpuOps
from pagewire.testing.gguf_writer import random_blocks
from tests.kernels.test_gguf_blocks import dequantized

gguf = pytest.importorskip("gguf")
# every type pack() takes, by the tile type it multiplies as (the K-quants: superblock tiles)
TILE = {"Q4_0": quant.Q4_1, "Q4_1": quant.Q4_1, "Q8_0": quant.Q8_0, "Q5_0": quant.Q8_0,
        "IQ4_NL": quant.Q8_0, "Q5_1": quant.Q5_K, "Q2_K": quant.Q2_KS, "Q3_K": quant.Q6_KS,
        "Q4_K": quant.Q4_KS, "Q5_K": quant.Q5_KS, "Q6_K": quant.Q6_KS, "IQ4_XS": quant.IQ4_XSS,
        "MXFP4": quant.Q8_0}
# the types kept as level tiles (nibbles indexing a codebook) where the library has them
# (native.Library.quant_kind: the avx2 and avx512 tiers), else TILE's Q8_0 tiles
LEVEL = {"IQ4_NL": quant.IQ4_NL, "MXFP4": quant.MXFP4, "IQ4_XS": quant.IQ4_XSL}
# and as bit planes (test_quant_planes.py: the avx512_bf16 tier's)
PLANES = {"Q3_K": quant.Q6_KP, "Q6_K": quant.Q6_KP, "Q5_K": quant.Q5_KP}


def kept_as(native_lib, qtype: str, offset: int) -> int:
    """The tile type a `qtype` weight packs as with that rounding's kind offset."""
    for kept in (LEVEL, PLANES):
        if qtype in kept and native_lib.quant_kind(kept[qtype] + offset):
            return kept[qtype]
    return TILE[qtype]
ALL = sorted(TILE)
# the type pack() takes: the file's, or a K-quant's superblock tile type (blocks_of converts
# them, as the loader does)
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")   # and IQ4_XS's superblocks
TYPES = {qtype: TILE[qtype] if qtype in K_QUANTS else int(gguf.GGMLQuantizationType[qtype])
         for qtype in ALL}


def blocks_of(w: np.ndarray, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(32-weight blocks uint8 [rows, bytes] as pack() takes them, their values float64
    [rows, cols] as gguf-py dequantizes the file's): Q4_0, Q4_1, Q8_0, MXFP4 quantized from w
    by gguf-py; the others random blocks of w's shape (test_gguf_blocks.py), whose K-quant
    superblocks become 32-weight blocks of their superblock tile types."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_0", "Q4_1", "Q8_0", "MXFP4"):
        raw = torch.from_numpy(gguf.quants.quantize(w.astype(np.float32), kind).copy())
    else:
        raw = random_blocks(qtype, *w.shape, np.random.default_rng(w.shape[1]))
    values = torch.from_numpy(dequantized(raw, qtype).astype(np.float64))
    if qtype in K_QUANTS:
        raw = gguf_blocks.k_quant_super_blocks(int(kind), raw)[1]
    return raw, values


def cols_of(qtype: str, cols: int) -> int:
    """`cols`, or the K-quants' nearest whole superblocks (256 weights)."""
    return max(256, cols // 256 * 256) if qtype in K_QUANTS else cols


def test_q4_1_tile_layout(native_lib):
    raw = torch.arange(32 * 2 * 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    raw = raw.reshape(32, 40)                                # 32 rows, 2 blocks of 20 bytes
    tiles = quant.pack(quant.Q4_1, raw, 64, native_lib).tiles   # [2 groups, 2 blocks, 320]
    assert tiles.shape == (2, 2, 320)
    for row, block in ((0, 0), (5, 1), (17, 0), (31, 1)):
        src, tile = raw[row, block * 20:(block + 1) * 20], tiles[row // 16, block]
        lane = row % 16
        assert tile[256 + 2 * lane: 258 + 2 * lane].tolist() == src[0:2].tolist()   # d
        assert tile[288 + 2 * lane: 290 + 2 * lane].tolist() == src[2:4].tolist()   # m
        for i in range(16):                                  # qs byte i: step i // 2, pair i % 2
            assert tile[(i // 2) * 32 + 2 * lane + i % 2] == src[4 + i]


def test_q8_0_tile_layout(native_lib):
    raw = torch.arange(16 * 34, dtype=torch.int64).remainder(253).to(torch.uint8).reshape(16, 34)
    tile = quant.pack(quant.Q8_0, raw, 32, native_lib).tiles[0, 0]
    assert tile.shape == (544,)
    for row in (0, 9, 15):
        assert tile[512 + 2 * row: 514 + 2 * row].tolist() == raw[row, 0:2].tolist()
        assert [int(tile[16 * k + row]) for k in range(32)] == raw[row, 2:].tolist()


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("tokens", [1, 3, 8, 13])   # 13: a chunk of 8, then one of 5
def test_float32_products_equal_dequantized_weights(native_lib, qtype, tokens):
    """float32 activations keep float32's precision: the error stays within the worst-case
    rounding bound of a float32 sum of K products (K * 2^-24 of the sum of magnitudes)."""
    rng = np.random.default_rng(tokens)
    cols = cols_of(qtype, 96)
    raw, w = blocks_of(rng.standard_normal((48, cols)) * 0.1, qtype)
    x = torch.from_numpy(rng.standard_normal((tokens, cols)).astype(np.float32))
    out = quant.matmul(x, quant.pack(TYPES[qtype], raw, cols, native_lib))
    ref = x.double() @ w.T
    bound = (x.double().abs() @ w.abs().T) * cols * 2.0 ** -24
    assert out.dtype == torch.float32 and out.shape == (tokens, 48)
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("tokens", [1, 5, 13])  # Q8 tiles from 4 tokens as vdpbf16ps pairs
def test_bfloat16_products_are_rounded_exact_sums(native_lib, qtype, tokens):
    """bfloat16 activations times the exact weights, summed in float32, rounded once."""
    rng = np.random.default_rng(1)
    cols = cols_of(qtype, 576)
    raw, w = blocks_of(rng.standard_normal((64, cols)) * 0.1, qtype)
    x = torch.from_numpy(rng.standard_normal((tokens, cols)).astype(np.float32)).bfloat16()
    out = quant.matmul(x, quant.pack(TYPES[qtype], raw, cols, native_lib))
    ref = x.double() @ w.T
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.abs().T) * 1e-6
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs() <= bound).all()


def test_linear_uses_the_quantized_weight_up_to_max_tokens(native_lib):
    rng = np.random.default_rng(2)
    raw, w = blocks_of(rng.standard_normal((32, 64)), "Q4_1")
    linear = Linear(64, 32, bias=True)
    with torch.no_grad():
        linear.weight.copy_(w.float())
        linear.bias.copy_(torch.arange(32, dtype=torch.float32))
    weight = quant.pack(quant.Q4_1, raw, 64, native_lib)
    linear.use_quantized(weight, max_tokens=4)
    small, large = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(linear.forward(small), quant.matmul(small, weight) + linear.bias)
    assert torch.equal(linear.forward(large), torch.nn.functional.linear(large, linear.weight,
                                                                         linear.bias))
    with pytest.raises(ValueError, match="does not fit"):
        Linear(32, 32).use_quantized(weight, 4)


def test_a_float_partial_linear_returns_unrounded_float32_sums(native_lib):
    """A row-parallel projection under tensor parallelism (float_partial) gives float32 sums
    from bfloat16 activations on each path: the blocks (small steps), the dense weight before
    packing, and the packed one (packed in float32 for it)."""
    rng = np.random.default_rng(3)
    raw, w = blocks_of(rng.standard_normal((32, 64)), "Q4_1")
    linear = Linear(64, 32, bias=False, float_partial=True).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(w.bfloat16())
    small, large = torch.randn(4, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    ref = large.double() @ linear.weight.double().T
    dense = linear.forward(large)
    assert dense.dtype == torch.float32
    assert torch.equal(dense, torch.nn.functional.linear(large.float(), linear.weight.float()))
    weight = quant.pack(quant.Q4_1, raw, 64, native_lib)
    linear.use_quantized(weight, max_tokens=4)
    assert torch.equal(linear.forward(small), quant.matmul(small.float(), weight))
    linear.pack()
    assert linear.packed.dtype == torch.float32
    packed = linear.forward(large)
    assert packed.dtype == torch.float32
    assert ((packed.double() - ref).abs() <= ref.abs() * 1e-5 + 1e-5).all()
    assert not torch.equal(packed, packed.bfloat16().float())      # not rounded to bfloat16


def test_shapes_that_cannot_be_packed(native_lib):
    assert quant.packable(quant.Q4_1, 48, 96)
    assert not quant.packable(quant.Q4_1, 40, 96)            # rows: groups of 16
    assert not quant.packable(quant.Q4_1, 48, 80)            # columns: blocks of 32
    assert not quant.packable(16, 48, 256)                   # IQ2_XXS: no kernel
    with pytest.raises(ValueError, match="cannot pack"):
        quant.pack(quant.Q8_0, torch.zeros(40, 34, dtype=torch.uint8), 32, native_lib)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        quant.matmul(torch.zeros(2, 32, dtype=torch.float16),
                     quant.pack(quant.Q8_0, torch.zeros(16, 34, dtype=torch.uint8), 32,
                                native_lib))


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 13, 101])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding, top", [("int8", 127), ("int16", 127 * 128)])
def test_integer_activation_products_are_within_their_rounding(native_lib, qtype, tokens, dtype,
                                                               rounding, top):
    """Activations rounded per 32-column block to int8 (scale max|x| / 127) or int16 (max|x| /
    16256) move each by at most max|x_block| / (2 top): the output stays within sum over
    blocks of that times sum|w| (plus the output's own rounding), and the weights are the
    file's exact values. Token counts cross each kernel's batch of 2 or 4 tokens a pass (the Q8
    tiles' int16 kernel sums both halves in one pass for 1 and 2 tokens, a half a pass for 3); from
    12, int16 steps take the GEMM (csrc/quant_gemm_avx2.h): 13 is four of its 3-token
    kernels and one of 1, 101 a chunk of 96 tokens, then 3 + 2."""
    _assert_within_rounding(native_lib, qtype, tokens, dtype, rounding, top, cols_of(qtype, 96))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K", "Q2_K"])
def test_int16_gemm_on_long_rows(native_lib, qtype):
    """The GEMM over rows of 33-40 blocks (the default model's down projection has 48), with
    and without minimums and with two scales a block (Q6_K, Q2_K)."""
    cols = 1280 if qtype in K_QUANTS else 1056
    _assert_within_rounding(native_lib, qtype, 20, torch.float32, "int16", 127 * 128, cols)


def test_the_int16_multiply_add_rate_is_measured(native_lib):
    """csrc/core_rates.cpp times vpmaddwd + vpaddd against FMAs on this core: a plausible
    ratio (16 multiply-adds an instruction against 8, at a quarter to twice the issue rate),
    measured once a library."""
    ratio = native_lib.int16_mac_ratio
    assert 0.2 < ratio < 5
    assert native_lib.int16_mac_ratio is ratio


@pytest.mark.parametrize("rounding", ["exact", "int16"])
def test_blocks_serve_large_steps_where_int16_products_outrun_fmas(native_lib, monkeypatch,
                                                                   rounding):
    """Only int16 blocks on the avx2 tier take the GEMM for large steps, and only on a core
    whose int16 multiply-adds run INT16_GEMM_MIN_RATIO times its FMAs' (Zen 3 and 4 do, Zen 1
    and Haswell do not): elsewhere a dense float32 copy serves them."""
    rng = np.random.default_rng(0)
    raw, _ = blocks_of(rng.standard_normal((48, 64)) * 0.1, "Q4_1")
    weight = quant.pack(TYPES["Q4_1"], raw, 64, native_lib, rounding)
    gemm = rounding == "int16" and native_lib.tier == "avx2"
    int16_gemm = CpuOps(native_lib).capabilities.int16_large_steps
    assert int16_gemm == (native_lib.tier == "avx2")          # the backend's record says so
    for ratio, fast in ((1.7, True), (quant.INT16_GEMM_MIN_RATIO, True), (1.0, False)):
        monkeypatch.setattr(native_lib, "int16_mac_ratio", ratio)
        assert quant.blocks_serve_large_steps(weight, native_lib, int16_gemm) == \
            (gemm and fast), ratio





def _assert_within_rounding(native_lib, qtype, tokens, dtype, rounding, top, cols):
    rng = np.random.default_rng(tokens)
    raw, w = blocks_of(rng.standard_normal((48, cols)) * 0.1, qtype)
    weight = quant.pack(TYPES[qtype], raw, cols, native_lib, rounding)
    offset = {"int8": 100, "int16": 200}[rounding]
    assert weight.kind == kept_as(native_lib, qtype, offset) + offset
    x = torch.from_numpy(rng.standard_normal((tokens, cols)).astype(np.float32)).to(dtype)
    _check_within_rounding(quant.matmul(x, weight), x, w, top, dtype)


def _check_within_rounding(out, x, w, top, dtype):
    """out (x @ w.T with x rounded per 32-column block to integers of at most `top`) is
    within the rounding's bound of the float64 product, and rounded indeed (float32)."""
    tokens, out = x.shape[0], out.double()
    ref = x.double() @ w.T
    bound = x.double().abs().reshape(tokens, -1, 32).amax(-1) @ \
        w.abs().reshape(w.shape[0], -1, 32).sum(-1).T / (2 * top)
    output_rounding = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 1e-6)
    assert ((out - ref).abs() <= bound * 1.001 + output_rounding + 1e-6).all()
    if dtype == torch.float32:
        assert ((out - ref).abs() > 0).any()                # rounded indeed, not exact


@pytest.mark.parametrize("rounding, top", [("exact", None), ("int8", 127), ("int16", 127 * 128)])
def test_mxfp4_exponents_beyond_fp16_multiply_as_q6_k_tiles(native_lib, rounding, top):
    """MXFP4 blocks whose scales 2^(e - 128) fp16 cannot hold (2^-38..2^31 here) take Q6_K's
    float32 scales: float32 activations' products within float32 rounding of the exact
    weights', integer ones within their rounding."""
    rng = np.random.default_rng(5)
    raw = random_blocks("MXFP4", 32, 256, rng)
    raw.view(32, 8, 17)[..., 0] = torch.from_numpy(rng.integers(90, 160, (32, 8), dtype=np.uint8))
    w = torch.from_numpy(dequantized(raw, "MXFP4")).double()
    weight = quant.pack(quant.MXFP4, raw, 256, native_lib, rounding)
    assert weight.kind == quant.Q6_K + {"exact": 0, "int8": 100, "int16": 200}[rounding]
    x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
    out = quant.matmul(x, weight)
    if top is not None:
        _check_within_rounding(out, x, w, top, torch.float32)
        return
    bound = (x.double().abs() @ w.abs().T) * 256 * 2.0 ** -24
    assert ((out.double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("rounding", ["int8", "int16"])
def test_q8_0_tile_layout_for_integer_activations(native_lib, rounding):
    """A row's four adjacent columns together: byte [j][l][c] is column 4j + c of row l."""
    raw = torch.arange(16 * 34, dtype=torch.int64).remainder(253).to(torch.uint8).reshape(16, 34)
    tile = quant.pack(quant.Q8_0, raw, 32, native_lib, rounding).tiles[0, 0]
    for row in (0, 9, 15):
        assert tile[512 + 2 * row: 514 + 2 * row].tolist() == raw[row, 0:2].tolist()
        assert [int(tile[64 * (k // 4) + 4 * row + k % 4]) for k in range(32)] == \
            raw[row, 2:].tolist()


def test_k_quant_tile_layout(native_lib):
    """Q4_K: Q4_1's nibbles, then d[16] and m[16] float32; Q6_K (exact): Q8_0's bytes, then
    the scales of columns 0-15 and of 16-31 of each row, float32."""
    raw = torch.arange(16 * 24, dtype=torch.int64).remainder(251).to(torch.uint8)
    tile = quant.pack(quant.Q4_K, raw.reshape(16, 24), 32, native_lib).tiles[0, 0]
    assert tile.shape == (384,)
    for row in (0, 7, 15):
        src = raw.reshape(16, 24)[row]
        assert tile[256 + 4 * row: 260 + 4 * row].tolist() == src[0:4].tolist()     # d
        assert tile[320 + 4 * row: 324 + 4 * row].tolist() == src[4:8].tolist()     # m
        assert [int(tile[(i // 2) * 32 + 2 * row + i % 2]) for i in range(16)] == \
            src[8:].tolist()
    raw = torch.arange(16 * 40, dtype=torch.int64).remainder(253).to(torch.uint8)
    tile = quant.pack(quant.Q6_K, raw.reshape(16, 40), 32, native_lib).tiles[0, 0]
    assert tile.shape == (640,)
    for row in (0, 9, 15):
        src = raw.reshape(16, 40)[row]
        assert tile[512 + 4 * row: 516 + 4 * row].tolist() == src[0:4].tolist()
        assert tile[576 + 4 * row: 580 + 4 * row].tolist() == src[4:8].tolist()
        assert [int(tile[16 * k + row]) for k in range(32)] == src[8:].tolist()


@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize("rounding", ["exact", "int8", "int16"])
def test_superblock_tiles_multiply_as_the_classic_tiles(native_lib, qtype, rounding):
    """A K-quant's superblock tiles (its scales as stored: int8 beside an fp16 d a superblock)
    give, bit for bit, what the classic tiles (float32 scales a block) give, in every kernel:
    1 and 5 tokens the small ones, 20 the GEMMs; in fewer bytes (Q4_K: 37 a 64 weights, the
    file's 36, against 48). Except Q6_K's and Q3_K's exact products on avx512_bf16, whose
    superblock tiles take six-bit codes' bfloat16 pairs (SixBitCodes) where the classic ones
    (also IQ4_XS's, of any int8) widen to float32: equal to float32 rounding there; and
    IQ4_XS's level tiles (avx2, avx512), whose one scale a block meets all 32 columns' sum
    where the classic tiles' two meet 16 each."""
    rng = np.random.default_rng(2)
    kind = int(gguf.GGMLQuantizationType[qtype])
    raw = random_blocks(qtype, 32, 512, rng)
    w = torch.from_numpy(dequantized(raw, qtype)).double()
    sup = quant.pack(*gguf_blocks.k_quant_super_blocks(kind, raw), 512, native_lib, rounding)
    classic = quant.pack(*gguf_blocks.k_quant_blocks(kind, raw), 512, native_lib, rounding)
    offset = classic.kind - classic.kind % 100
    level = qtype in LEVEL and native_lib.quant_kind(LEVEL[qtype] + offset)
    assert sup.kind == kept_as(native_lib, qtype, offset) + offset
    assert sup.nbytes < classic.nbytes
    if qtype == "Q4_K":
        assert (sup.nbytes, classic.nbytes) == (32 * 512 * 37 // 64, 32 * 512 * 48 // 64)
    if level:          # 2208 bytes a 16 x 256 superblock: 4.31 bits a weight
        assert sup.nbytes == 32 * 512 // 256 * 2208 // 16
    reordered = level or native_lib.tier == "avx512_bf16" and rounding == "exact" and \
        qtype in ("Q3_K", "Q6_K")
    for tokens in (1, 5, 20):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.from_numpy(rng.standard_normal((tokens, 512)).astype(np.float32)).to(dtype)
            out, ref = quant.matmul(x, sup), quant.matmul(x, classic)
            if reordered:
                bound = (x.double().abs() @ w.abs().T) * 512 * 2.0 ** -23 + \
                    (ref.double().abs() * 2.0 ** -8 if dtype == torch.bfloat16 else 0)
                assert ((out.double() - ref.double()).abs() <= bound).all(), (tokens, dtype)
            else:
                assert torch.equal(out, ref), (tokens, dtype)


def test_a_share_cut_inside_a_superblock_takes_classic_tiles(native_lib):
    """A rank's columns that start inside a superblock (its 8 blocks' heads differ) pack as
    the classic tiles of the same values: a tile of 8 blocks needs one head a row."""
    raw = random_blocks("Q4_K", 16, 512, np.random.default_rng(4))
    values = torch.from_numpy(dequantized(raw, "Q4_K")).double()
    _, blocks = gguf_blocks.k_quant_super_blocks(gguf_blocks.Q4_K, raw)
    share = blocks[:, 4 * 22:12 * 22]                      # columns 128-383: blocks 4-11
    weight = quant.pack(quant.Q4_KS, share, 256, native_lib)
    assert weight.kind == quant.Q4_K
    x = torch.randn(2, 256)
    ref = x.double() @ values[:, 128:384].T
    assert torch.allclose(quant.matmul(x, weight).double(), ref, rtol=1e-5, atol=1e-5)


def test_superblock_tile_layout(native_lib):
    """Q4_K's superblock tile: 8 blocks of Q4_1's nibble layout, int8 [8 blocks][scale,
    minimum][16 rows], then fp16 d[16] and -dmin[16]."""
    raw = random_blocks("Q4_K", 16, 256, np.random.default_rng(5))
    _, blocks = gguf_blocks.k_quant_super_blocks(gguf_blocks.Q4_K, raw)
    tile = quant.pack(quant.Q4_KS, blocks, 256, native_lib).tiles[0, 0]
    assert tile.shape == (2368,)
    heads, scales, quants = gguf_blocks.super_parts(quant.Q4_KS, blocks)
    for row, block in ((0, 0), (7, 3), (15, 7)):
        lane = row % 16
        for a in range(2):
            assert tile[2048 + (block * 2 + a) * 16 + lane] == scales[row, block, a].view(
                torch.uint8)
            head = tile[2304 + a * 32 + 2 * lane: 2306 + a * 32 + 2 * lane]
            assert head.view(torch.float16) == heads[row, block, a]
        for i in range(16):
            assert tile[block * 256 + (i // 2) * 32 + 2 * lane + i % 2] == quants[row, block, i]
    d = torch.from_numpy(raw.numpy()[:, 0:2].copy()).view(torch.float16)
    assert torch.equal(heads[:, 0, 0:1], d)                 # the file's d, as stored


@pytest.mark.parametrize("tokens", [1, 6])
def test_a_weight_of_segments_of_different_types_multiplies_each_into_its_own_columns(
        native_lib, tokens):
    """Q4_K rows, then Q6_K (superblock tiles), then Q8_0 (int16 activations) as one weight:
    each segment's products land in its own output columns, as the whole weight's would."""
    rng = np.random.default_rng(tokens)
    parts = [blocks_of(rng.standard_normal((rows, 256)) * 0.1, qtype)
             for qtype, rows in (("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 48))]
    weight = quant.QuantWeight.joined(
        [quant.pack(TYPES[qtype], raw, 256, native_lib, rounding) for (raw, _), qtype, rounding
         in zip(parts, ("Q4_K", "Q6_K", "Q8_0"), ("exact", "exact", "int16"))], native_lib)
    assert weight.rows == 96 and weight.kind is None
    assert weight.table.tolist() == [3, 0, weight.segments[0].tiles.data_ptr(), quant.Q4_KS, 32,
                                     weight.segments[1].tiles.data_ptr(),
                                     kept_as(native_lib, "Q6_K", 0), 16,
                                     weight.segments[2].tiles.data_ptr(), quant.Q8_0 + 200, 48]
    x = torch.from_numpy(rng.standard_normal((tokens, 256)).astype(np.float32))
    out = quant.matmul(x, weight)
    for (raw, w), qtype, rounding, cols in zip(parts, ("Q4_K", "Q6_K", "Q8_0"),
                                               ("exact", "exact", "int16"),
                                               (slice(0, 32), slice(32, 48), slice(48, 96))):
        alone = quant.matmul(x, quant.pack(TYPES[qtype], raw, 256, native_lib, rounding))
        assert torch.equal(out[:, cols], alone)


def test_a_weight_in_another_column_order_takes_x_in_that_order(native_lib):
    """Blocks holding W's columns in `order` (GPTQ act-order) times x: x @ W^T, as the blocks
    of W's own order give (the same sums in another order: float32 rounding apart)."""
    rng = np.random.default_rng(9)
    raw, held = blocks_of(rng.standard_normal((32, 96)) * 0.1, "Q8_0")
    order = torch.from_numpy(rng.permutation(96))
    w = torch.empty_like(held).index_copy_(1, order, held)       # W[:, order] = the blocks'
    weight = quant.QuantWeight.joined([quant.pack(quant.Q8_0, raw, 96, native_lib)],
                                      native_lib, order)
    assert weight.table.tolist()[:2] == [1, order.data_ptr()]
    x = torch.from_numpy(rng.standard_normal((3, 96)).astype(np.float32))
    ref = x.double() @ w.T
    assert ((quant.matmul(x, weight).double() - ref).abs() <= 1e-5).all()
    with pytest.raises(ValueError, match="int64 \\[96\\]"):
        quant.QuantWeight.joined([weight], native_lib, order[:95])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 9, 21])
def test_bf16_tiles_multiply_with_exact_products(native_lib, dtype, tokens):
    """A bfloat16 checkpoint's weight as BF16 tiles: line j of a tile holds columns 2j and
    2j + 1 of its 16 rows, a row's pair in one lane; every product exact, the sums float32
    (float32 activations keep their precision: three bfloat16 parts, or float32 lanes)."""
    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(48, 96, generator=g).bfloat16()
    qw = quant.pack_bf16(w, native_lib)
    assert qw.kind == quant.BF16 and tuple(qw.tiles.shape) == (3, 3, 1024)
    lines = qw.tiles[1, 2].view(torch.bfloat16).view(16, 16, 2)        # [line, row, pair]
    assert torch.equal(lines[5, 7], w[16 + 7, 64 + 10:64 + 12])
    x = torch.randn(tokens, 96, generator=g).to(dtype)
    exact = x.double() @ w.double().T
    out = quant.matmul(x, qw)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-5)
    else:                                # rounded once: within one bfloat16 step of exact
        assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    with pytest.raises(ValueError, match="BF16 tiles"):
        quant.pack_bf16(w[:40], native_lib)                  # rows not a multiple of 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_blocks_decode_every_e4m3_code_exactly(native_lib, dtype):
    """An FP8 checkpoint's codes as blocks (a float32 scale per row, then 32 e4m3 codes):
    every code but NaN, subnormals and negatives included, multiplies as its value times the
    scale."""
    from pagewire.executor.checkpoint_formats import _fp8_blocks, _fp8_values
    codes = torch.tensor([c for c in range(256) if c & 0x7f != 0x7f], dtype=torch.uint8)
    codes = torch.cat([codes, codes[:2]]).view(8, 32).repeat(2, 1)       # every code
    w = torch.cat([codes.view(torch.float8_e4m3fn)] * 4, 1)                      # [16, 128]
    t = {"weight": w, "weight_scale": torch.linspace(0.5, 2.0, 16)}
    kind, raw = _fp8_blocks(t)
    assert kind == quant.FP8 and tuple(raw.shape) == (16, 4 * 36)
    x = torch.eye(128).to(dtype)                              # each column's values alone
    out = quant.matmul(x, quant.pack(kind, raw, 128, native_lib)).float()
    assert torch.equal(out, _fp8_values(t).T.to(dtype).float())
    with pytest.raises(ValueError, match="FP8: exact"):
        quant.pack(kind, raw, 128, native_lib, "int16")
