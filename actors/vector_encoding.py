"""Pooled vectors as bytes, vLLM's way (`embed_dtype`, `endianness` on /v1/embeddings and
/pooling): float32, float16, bfloat16 or an fp8 format, in the byte order asked. numpy only
(the gateway loads no torch); each conversion rounds to nearest, ties to even, as torch's
`Tensor.to(dtype)` does, bit for bit for every value but a NaN's payload
(tests/actors/test_vector_encoding.py), so a client that decodes with torch gets the values
vLLM would have sent."""
from __future__ import annotations

import sys

import numpy as np

EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ENDIANNESS = ("native", "big", "little")
_FOREIGN = "big" if sys.byteorder == "little" else "little"     # the order that swaps bytes
_WIDTH = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def check_embed_dtype(embed_dtype: str, endianness: str) -> None:
    """ValueError naming the choices where either is not one (the gateway answers 400)."""
    if embed_dtype not in EMBED_DTYPES:
        raise ValueError(f"embed_dtype must be one of {', '.join(EMBED_DTYPES)}, got "
                         f"{embed_dtype!r}")
    if endianness not in ENDIANNESS:
        raise ValueError(f"endianness must be one of {', '.join(ENDIANNESS)}, got "
                         f"{endianness!r}")


def item_bytes(embed_dtype: str) -> int:
    """Bytes a value takes in `embed_dtype`."""
    return _WIDTH[embed_dtype]


def vector_bytes(values: np.ndarray, embed_dtype: str = "float32",
                 endianness: str = "native") -> bytes:
    """`values` (any shape, read as float32, row-major) in `embed_dtype`, its values' bytes in
    `endianness` (native: this machine's)."""
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if embed_dtype == "float32":
        out = x
    elif embed_dtype == "float16":
        with np.errstate(over="ignore"):                    # past 65504: infinity, as torch
            out = x.astype(np.float16)
    elif embed_dtype == "bfloat16":
        out = _bfloat16_bits(x)
    elif embed_dtype in _FP8:
        return _fp8_codes(x, *_FP8[embed_dtype]).tobytes()      # one byte: no order
    else:
        check_embed_dtype(embed_dtype, endianness)
    if endianness == _FOREIGN:
        out = out.byteswap()
    return out.tobytes()


def _bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16's 16 bits (uint16): the upper half, rounded to nearest even; a NaN
    stays a quiet NaN of its sign (torch's NaN bits differ; NaN is all either says)."""
    bits = x.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def _fp8_magnitudes(exponent_bits: int, mantissa_bits: int, last_code: int) -> np.ndarray:
    """The values of codes 0..last_code (sign clear), in order: subnormals at exponent 0."""
    bias = (1 << (exponent_bits - 1)) - 1
    codes = np.arange(last_code + 1)
    e, m = codes >> mantissa_bits, codes & ((1 << mantissa_bits) - 1)
    scale = float(1 << mantissa_bits)
    return np.where(e == 0, m / scale * 2.0 ** (1 - bias),
                    (1 + m / scale) * 2.0 ** (e - bias))


# name -> (the magnitudes of codes 0..last, the code a NaN takes). e4m3fn has no infinity:
# torch saturates, so what lies past its largest value (448, code 0x7E), infinity too, is
# 448; 0x7F is NaN. e5m2: 0x7C is infinity (65536 in the table), so what rounds past 57344
# is infinity; 0x7F is NaN.
_FP8 = {"fp8_e4m3": (_fp8_magnitudes(4, 3, 0x7E), 0x7F),
        "fp8_e5m2": (_fp8_magnitudes(5, 2, 0x7C), 0x7F)}


def _fp8_codes(x: np.ndarray, magnitudes: np.ndarray, nan_code: int) -> np.ndarray:
    """float32 -> fp8 codes (uint8): |x| to the nearest magnitude, ties to the even code
    (consecutive codes alternate their mantissa's last bit), the sign bit ORed on."""
    a = np.abs(x).astype(np.float64)
    last = len(magnitudes) - 1
    hi = np.minimum(np.searchsorted(magnitudes, a), last)      # magnitudes[hi] >= a, or last
    lo = np.maximum(hi - 1, 0)
    below, above = a - magnitudes[lo], magnitudes[hi] - a
    take_hi = (above < below) | ((above == below) & (hi % 2 == 0)) | (a >= magnitudes[last])
    codes = np.where(take_hi, hi, lo).astype(np.uint8)
    codes[np.isnan(x)] = nan_code
    return codes | (np.signbit(x).astype(np.uint8) << 7)
