"""GGUF tensors of every type we read, written with gguf-py from known weights, read back by our
loader: equal to gguf-py's own dequantization bit for bit, and to the known weights within
the format's quantization error. Then whole tiny models written as GGUF, llama.cpp's way."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.executor.gguf_weights import read_tensor
from pagewire.gguf_header import read_gguf_header

# Largest error allowed against the original weights, as a fraction of each block's max |w|:
# half a step of the format (Q4_0's 16 steps reach -8d..7d, so the far end clips by one more).
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 0.006, "Q4_0": 0.13, "Q4_1": 0.07}
SHAPE = (6, 512)


def _write(path, arrays: dict[str, tuple[np.ndarray, object]]) -> str:
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, raw_dtype) in arrays.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _read_back(path: str, name: str, dtype=torch.float32) -> tuple[torch.Tensor, np.ndarray]:
    """(our tensor, gguf-py's dequantization of the same bytes)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    info = read_gguf_header(path).tensors[name]
    ours = read_tensor(np.memmap(path, dtype=np.uint8, mode="r"), info, dtype)
    t = GGUFReader(path).get_tensor(0)
    theirs = dequantize(np.asarray(t.data), t.tensor_type).reshape(info.shape)
    return ours, np.array(theirs, dtype=np.float32)


def _block_max(w: np.ndarray, block: int) -> np.ndarray:
    amax = np.abs(w.reshape(-1, block)).max(axis=1, keepdims=True)
    return np.broadcast_to(amax, (amax.shape[0], block)).reshape(w.shape)


@pytest.mark.parametrize("qtype", sorted(TOLERANCE))
def test_simple_types_match_gguf_py_and_the_weights(tmp_path, qtype):
    import gguf
    from gguf.quants import quantize
    kind = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(1).normal(0, 0.1, SHAPE).astype(np.float32)
    data = quantize(w, kind)
    if qtype == "BF16":
        data = data.view(np.uint8)
    path = _write(tmp_path / "t.gguf", {"blk.0.attn_q.weight": (data, None if qtype in ("F32", "F16") else kind)})
    ours, theirs = _read_back(path, "blk.0.attn_q.weight")
    assert ours.dtype == torch.float32 and tuple(ours.shape) == SHAPE
    assert torch.equal(ours, torch.from_numpy(theirs))
    err = np.abs(ours.numpy() - w)
    assert (err <= TOLERANCE[qtype] * _block_max(w, 32) + 1e-12).all(), float(err.max())


def _pack_q4_k(d, dmin, sc, mn, q) -> np.ndarray:
    """ggml's block_q4_K from its parts: d, dmin [n] f16; sc, mn [n, 8] 6-bit; q [n, 256] 4-bit."""
    n = d.shape[0]
    scales = np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                             (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=1)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                           scales.astype(np.uint8), qs.astype(np.uint8)], axis=1)


def _pack_q6_k(d, scales, q) -> np.ndarray:
    """ggml's block_q6_K: d [n] f16; scales [n, 16] int8; q [n, 256] in -32..31."""
    n = d.shape[0]
    u = (q + 32).astype(np.uint8).reshape(n, 2, 128)
    low, high = (u & 0x0F).reshape(n, 2, 2, 64), (u >> 4).reshape(n, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8),
                           d.view(np.uint8).reshape(n, 2)], axis=1)


def _k_quant(qtype: str, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(block bytes, the float32 weights they encode), from random parts."""
    d = rng.uniform(0.001, 0.01, n).astype(np.float16)
    if qtype == "Q4_K":
        dmin = rng.uniform(0.001, 0.01, n).astype(np.float16)
        sc, mn = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
        q = rng.integers(0, 16, (n, 256), dtype=np.uint8)
        scale = (d.astype(np.float32)[:, None] * sc).repeat(32, axis=1)
        offset = (dmin.astype(np.float32)[:, None] * mn).repeat(32, axis=1)
        return _pack_q4_k(d, dmin, sc, mn, q), scale * q.astype(np.float32) - offset
    scales = rng.integers(-128, 128, (n, 16)).astype(np.int8)
    q = rng.integers(-32, 32, (n, 256))
    scale = (d.astype(np.float32)[:, None] * scales.astype(np.float32)).repeat(16, axis=1)
    return _pack_q6_k(d, scales, q), scale * q.astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_match_gguf_py_and_the_weights(tmp_path, qtype):
    """gguf-py cannot quantize K-quants: the blocks are packed here from known parts (scales,
    mins, quants), so the weights they encode are known exactly."""
    import gguf
    rows, cols = SHAPE
    blocks, w = _k_quant(qtype, rows * cols // 256, np.random.default_rng(2))
    kind = gguf.GGMLQuantizationType[qtype]
    path = _write(tmp_path / "k.gguf", {"blk.0.ffn_down.weight": (blocks.reshape(rows, -1), kind)})
    ours, theirs = _read_back(path, "blk.0.ffn_down.weight")
    assert torch.equal(ours, torch.from_numpy(theirs))
    assert torch.equal(ours, torch.from_numpy(w.reshape(SHAPE)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_converted_as_read(tmp_path, dtype):
    import gguf
    from gguf.quants import quantize
    w = np.random.default_rng(3).normal(0, 0.1, SHAPE).astype(np.float32)
    kind = gguf.GGMLQuantizationType.Q4_1
    path = _write(tmp_path / "c.gguf", {"output.weight": (quantize(w, kind), kind)})
    ours, theirs = _read_back(path, "output.weight", dtype)
    assert ours.dtype == dtype
    assert torch.equal(ours, torch.from_numpy(theirs).to(dtype))
