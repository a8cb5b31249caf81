"""GGUF tensors of every type we read, written with gguf-py from known weights, read back by our
loader: equal to gguf-py's own dequantization bit for bit, and to the known weights within
the format's quantization error. Then whole tiny models written as GGUF, llama.cpp's way."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.executor.gguf_weights import read_tensor
from pagewire.gguf_header import read_gguf_header
from pagewire.testing.gguf_writer import k_quant_from_parts

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


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_match_gguf_py_and_the_weights(tmp_path, qtype):
    """gguf-py cannot quantize K-quants: the blocks are packed here from known parts (scales,
    mins, quants), so the weights they encode are known exactly."""
    import gguf
    rows, cols = SHAPE
    blocks, w = k_quant_from_parts(qtype, rows * cols // 256, np.random.default_rng(2))
    kind = gguf.GGMLQuantizationType[qtype]
    path = _write(tmp_path / "k.gguf", {"blk.0.ffn_down.weight": (blocks.reshape(rows, -1), kind)})
    ours, theirs = _read_back(path, "blk.0.ffn_down.weight")
    assert torch.equal(ours, torch.from_numpy(theirs))
    assert torch.equal(ours, torch.from_numpy(w.reshape(SHAPE)))


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q5_K", "Q5_1", "IQ4_XS", "MXFP4"])
def test_other_types_read_as_gguf_py_reads_them(tmp_path, qtype):
    """Blocks of random bytes (tests/kernels/test_gguf_blocks.py): every bit pattern."""
    import gguf
    from pagewire.testing.gguf_writer import random_blocks
    rows, cols = SHAPE
    blocks = random_blocks(qtype, rows, cols, np.random.default_rng(4)).numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    path = _write(tmp_path / "o.gguf", {"blk.0.ffn_down.weight": (blocks, kind)})
    ours, theirs = _read_back(path, "blk.0.ffn_down.weight")
    assert torch.equal(ours, torch.from_numpy(theirs))


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
