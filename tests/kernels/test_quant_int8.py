"""Quantized matmuls with int8 activations (--quantized-activations int8, int8-prefill): the
small steps' kernels (csrc/quant_int_avx2.h; vpdpbusd's on avx512_bf16, quant_step_vnni.h),
the GEMMs for larger ones (quant_gemm_vnni.h on avx512_bf16 from 7 or 8 tokens by tile type,
kGemmFrom; quant_gemm_int8_avx2.h below it from 8 or 32), and which steps each serves."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.kernels import native, quant, tiers
from pagewire.kernels.ops import CpuOps
from tests.kernels.test_quant import ALL, TYPES, _check_within_rounding, blocks_of, cols_of


@pytest.mark.parametrize("rounding", ["exact", "int16", "int8", "int8-large"])
def test_int8_blocks_serve_large_steps_where_an_int8_gemm_runs(native_lib, rounding):
    """int8 (and int8-large) blocks take the int8 GEMM for large steps on avx512_bf16 (VNNI)
    and avx2 (whatever the int16 rate), other roundings there a dense copy (or avx2's int16
    GEMM: not asked here); a weight of int8 and exact segments too."""
    rng = np.random.default_rng(0)
    raw, _ = blocks_of(rng.standard_normal((48, 64)) * 0.1, "Q4_1")
    weight = quant.pack(TYPES["Q4_1"], raw, 64, native_lib, rounding)
    int8_gemm = CpuOps(native_lib).capabilities.int8_large_steps
    assert int8_gemm == (native_lib.tier in ("avx2", "avx512_bf16"))
    assert quant.blocks_serve_large_steps(weight, native_lib, False, int8_gemm) == \
        (int8_gemm and rounding.startswith("int8"))
    mixed = quant.QuantWeight.joined(
        [weight, quant.pack(TYPES["Q4_1"], raw, 64, native_lib, "exact")], native_lib)
    assert not quant.blocks_serve_large_steps(mixed, native_lib, False, int8_gemm)


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("tokens", [1, 7, 17, 100, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_equals_the_small_int8_kernels(native_lib, qtype, tokens, dtype):
    """Larger steps with int8 activations take a GEMM (vpdpbusd on avx512_bf16,
    csrc/quant_gemm_vnni.h; vpmaddubsw below it, quant_gemm_int8_avx2.h): the same integer
    sums and the same float steps in the same order, so its outputs equal, bit for bit, those
    of the small kernels (quant_int_avx2.h, quant_step_vnni.h; here a token a call, which
    every tier serves with them), and stay within the rounding of the torch reference. On
    VNNI Q4_0 (minimums -8 d) folds its minimum into the scale's FMA: equal to float32
    rounding (_assert_equal_but_folded). 7 tokens take VNNI's GEMM for Q6_K's planes only;
    17, 100 and 257 end in short sets after the GEMMs' calls of 8 (VNNI) or 2 (AVX2) tokens,
    257 past their 128-token chunk."""
    _assert_int8_gemm_equals_small(native_lib, qtype, tokens, dtype, cols_of(qtype, 320))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q2_K"])
def test_int8_gemm_on_long_rows(native_lib, qtype):
    """Rows of 40 blocks (a 1B model's down projection has 256), with and without minimums
    and with two scales a block (Q6_K, Q2_K)."""
    _assert_int8_gemm_equals_small(native_lib, qtype, 20, torch.float32, 1280)


def _assert_int8_gemm_equals_small(native_lib, qtype, tokens, dtype, cols):
    rng = np.random.default_rng(tokens)
    raw, w = blocks_of(rng.standard_normal((48, cols)) * 0.1, qtype)
    weight = quant.pack(TYPES[qtype], raw, cols, native_lib, "int8")
    x = torch.from_numpy(rng.standard_normal((tokens, cols)).astype(np.float32)).to(dtype)
    out = quant.matmul(x, weight)
    small = torch.cat([quant.matmul(x[t:t + 1], weight) for t in range(tokens)])
    _assert_equal_but_folded(out, small, qtype, x, w, dtype)
    _check_within_rounding(out, x, w, 127, dtype)


def _assert_equal_but_folded(out, small, qtype, x, w, dtype):
    """out equals small bit for bit, or for Q4_0 (whose minimum VNNI's GEMM folds) to float32
    rounding: a few units of 2^-24 of the sum of |x w|, bfloat16 outputs then to one unit
    of their last place."""
    if qtype == "Q4_0":
        tol = (x.double().abs() @ w.abs().T) * 1e-6 + \
            (small.double().abs() * 2.0 ** -8 if dtype == torch.bfloat16 else 0)
        assert ((out.double() - small.double()).abs() <= tol).all()
    else:
        assert torch.equal(out, small)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_for_large_steps_only(native_lib, qtype, dtype):
    """int8-large (--quantized-activations int8-prefill): a step of fewer than 8 tokens
    multiplies as the tier's default does (exact on avx512_bf16, int16 below it), one of 8 or
    more as the int8 tiles (the int8 GEMMs), bit for bit, on the same tiles; Q8 tiles are
    refused."""
    rng = np.random.default_rng(6)
    raw, _ = blocks_of(rng.standard_normal((32, 512)) * 0.1, qtype)
    packed = {r: quant.pack(TYPES[qtype], raw, 512, native_lib, r)
              for r in ("exact", "int16", "int8", "int8-large")}
    assert torch.equal(packed["int8-large"].tiles, packed["exact"].tiles)
    assert torch.equal(packed["int8-large"].tiles, packed["int16"].tiles)
    small = tiers.default_activations(native_lib.tier)
    assert small == ("exact" if native_lib.tier == "avx512_bf16" else "int16")
    for tokens, same in ((1, small), (7, small), (8, "int8"), (40, "int8")):
        x = torch.from_numpy(rng.standard_normal((tokens, 512)).astype(np.float32)).to(dtype)
        assert torch.equal(quant.matmul(x, packed["int8-large"]),
                           quant.matmul(x, packed[same])), tokens
    raw, _ = blocks_of(rng.standard_normal((16, 256)) * 0.1, "Q6_K")
    with pytest.raises(ValueError, match="int8-large takes Q4 tiles"):
        quant.pack(TYPES["Q6_K"], raw, 256, native_lib, "int8-large")


@pytest.mark.skipif("avx512_bf16" not in tiers.runnable(), reason="needs the avx512_bf16 tier")
@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_small_steps_equal_the_avx2_kernels(qtype, dtype):
    """Steps of 1-7 tokens (decode) with int8 activations take vpdpbusd on avx512_bf16
    (csrc/quant_step_vnni.h, and its GEMM from kGemmFrom tokens): the AVX2 kernels' integer
    sums and float steps in their order, so the outputs equal the avx2 library's bit for bit
    (Q4_0 in the GEMM to float32 rounding), on rows of 10 blocks (or 2 superblocks), tiles
    with and without minimums and with two scales a block, and level tiles. Both multiply
    the tiles avx512_bf16 packs (Q6_K's as Q6_KS's codes, which avx2 multiplies too: its bit
    planes equal them in test_quant_planes.py)."""
    vnni, avx2 = native.load("avx512_bf16"), native.load("avx2")
    cols = cols_of(qtype, 320)
    rng = np.random.default_rng(len(qtype))
    raw, w = blocks_of(rng.standard_normal((48, cols)) * 0.1, qtype)
    fast = quant.pack(TYPES[qtype], raw, cols, vnni, "int8", planes=False)
    reference = quant.QuantWeight(fast.segments, cols, avx2)
    for tokens in range(1, 8):
        x = torch.from_numpy(rng.standard_normal((tokens, cols)).astype(np.float32)).to(dtype)
        out = quant.matmul(x, fast)
        _assert_equal_but_folded(out, quant.matmul(x, reference), qtype, x, w, dtype)
        _check_within_rounding(out, x, w, 127, dtype)
