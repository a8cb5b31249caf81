"""vector_encoding (numpy) against torch's own conversions, bit for bit: every embed_dtype in
both byte orders, over values of every magnitude, the fp8 formats' exact ties, overflow,
infinities and signed zeros."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from pagewire.vector_encoding import EMBED_DTYPES, check_embed_dtype, item_bytes, vector_bytes

TORCH = {"float32": (torch.float32, torch.int32), "float16": (torch.float16, torch.int16),
         "bfloat16": (torch.bfloat16, torch.int16),
         "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
         "fp8_e5m2": (torch.float8_e5m2, torch.uint8)}


def values() -> np.ndarray:
    """Normal draws at scales from subnormal fp8 to past every format's range, each fp8
    format's midpoints between neighbouring codes (the ties), and the edges."""
    rng = np.random.default_rng(0)
    draws = [rng.standard_normal(20_000).astype(np.float32) * s
             for s in (1e-7, 1e-3, 1.0, 300.0, 1e4, 1e5)]
    ties = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(0, 0x7B, dtype=torch.uint8).view(dtype).float().numpy()
        ties.append(((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32))
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 448, 464, 470, 480, 1e30, 57344, 61440,
                      65504, 65520, 3.4e38, 2 ** -9, 2 ** -10, 2 ** -17], np.float32)
    x = np.concatenate(draws + ties + [edges])
    return np.concatenate([x, -x])


@pytest.mark.parametrize("dtype", EMBED_DTYPES)
@pytest.mark.parametrize("endianness", ["native", "little", "big"])
def test_bytes_equal_torchs_conversion(dtype, endianness):
    x = values()
    codes = torch.from_numpy(x).to(TORCH[dtype][0]).view(TORCH[dtype][1]).numpy()
    if endianness not in ("native", sys.byteorder):
        codes = codes.byteswap()
    got = vector_bytes(x, dtype, endianness)
    assert len(got) == x.size * item_bytes(dtype)
    assert got == codes.tobytes()


def test_shape_is_read_row_major_and_nan_stays_nan():
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert vector_bytes(rows, "float32", "big") == rows.reshape(-1).astype(">f4").tobytes()
    for dtype in ("bfloat16", "float16"):
        back = torch.frombuffer(bytearray(vector_bytes(np.float32([np.nan]), dtype)),
                                dtype=TORCH[dtype][0])
        assert torch.isnan(back).all()
    assert vector_bytes(np.float32([np.nan, -np.nan]), "fp8_e4m3") == bytes([0x7F, 0xFF])


def test_unknown_options_are_named():
    with pytest.raises(ValueError, match="embed_dtype must be one of float32, float16, "
                                         "bfloat16, fp8_e4m3, fp8_e5m2, got 'int8'"):
        check_embed_dtype("int8", "native")
    with pytest.raises(ValueError, match="endianness must be one of native, big, little"):
        check_embed_dtype("float32", "middle")
