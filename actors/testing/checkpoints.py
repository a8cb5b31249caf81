"""Quantized Hugging Face checkpoints written from known integer codes, for the tests of the
formats' readers (tests/actors/test_checkpoint_formats.py) and bench/formats.py.

Each format's packer (GPTQ v1 and v2, AWQ's interleaved nibbles, compressed-tensors
pack-quantized and int-quantized, FP8, MXFP4 by gguf-py's quantizer) rounds a float weight to
codes, scales and zeros and returns the tensors the format stores with the float values they
define; `write_quantized` rewrites a float checkpoint's linears in a format."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _short(scale: torch.Tensor) -> torch.Tensor:
    """float16 scales with 6 mantissa bits: -scale * zero (zero < 16) is exact in float16, so
    the blocks hold these fixtures' values exactly (a checkpoint's other scales: the minimum
    is rounded to float16, checkpoint_formats.py)."""
    return (scale.half().view(torch.int16) & ~0xF).view(torch.float16).float()


def _codes(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Round w [N, K] to codes [N, K], float16 scales [N, G] and zeros [N, G] (per group)."""
    n, k = w.shape
    size = k if group == -1 else group
    b = w.view(n, k // size, size)
    top = (1 << bits) - 1
    if symmetric:
        scale = _short(b.abs().amax(-1) / (top // 2))
        zero = torch.full(scale.shape, (top + 1) // 2)
    else:
        lo, hi = b.amin(-1), b.amax(-1)
        scale = _short((hi - lo) / top)
        zero = (-lo / scale).round().clamp(1, top)       # >= 1: GPTQ v1 stores zero - 1
    low = 1 if symmetric else 0          # symmetric: codes within +-(2^(bits-1) - 1) of zero
    codes = (b / scale[..., None] + zero[..., None]).round().clamp(low, top)
    return codes.view(n, k).to(torch.int32), scale.half(), zero.to(torch.int32)


def _pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes along `dim` into int32 words, the first in the low bits."""
    per = 32 // bits
    c = codes.movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, per).to(torch.int64)
    words = sum(c[..., i] << (bits * i) for i in range(per))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _gptq(w, bits, group, v1=True, sym=False, perm=None):
    codes, scale, zero = _codes(w, bits, group, sym)
    k = w.shape[1]
    g_idx = torch.arange(k) // (k if group == -1 else group)
    if perm is not None:        # act-order: column k's group is g_idx[perm][k]
        codes, g_idx = codes[:, perm], g_idx[perm]
    values = scale.float()[:, g_idx] * (codes - zero[:, g_idx]).float()
    tensors = {"qweight": _pack(codes.T, bits, 0), "qzeros": _pack(zero.T - int(v1), bits, 1),
               "scales": scale.T.contiguous(), "g_idx": g_idx.int()}
    return tensors, values


def _awq(w, group):
    codes, scale, zero = _codes(w, 4, group, False)
    values = scale.float().repeat_interleave(group, 1) * \
        (codes - zero.repeat_interleave(group, 1)).float()
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])

    def interleave(x):            # [R, C] -> nibble i of each word holds column order[i]
        return x.view(x.shape[0], -1, 8)[..., order].reshape(x.shape[0], -1)
    return {"qweight": _pack(interleave(codes.T.contiguous()), 4, 1),
            "qzeros": _pack(interleave(zero.T.contiguous()), 4, 1),
            "scales": scale.T.contiguous()}, values


def _w4a16(w, group):
    codes, scale, zero = _codes(w, 4, group, True)
    size = w.shape[1] if group == -1 else group
    scale = scale.bfloat16()                               # as llm-compressor writes them
    values = scale.float().repeat_interleave(size, 1) * (codes - 8).float()
    return {"weight_packed": _pack(codes, 4, 1), "weight_scale": scale,
            "weight_shape": torch.tensor(list(w.shape))}, values


def _w8a8(w, group):
    codes, scale, _ = _codes(w, 8, -1, True)
    q = (codes - 128).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale.float()}, scale.float() * q.float()


def _fp8(w, group, per_tensor=False):
    scale = w.abs().amax(1, keepdim=True) / 448
    if per_tensor:
        scale = scale.max()
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def mxfp4_pair(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] as a Hugging Face MXFP4 pair, gguf-py's rounding (blocks uint8 [..., N,
    K / 32, 16]: weights 2j and 2j + 1 in byte j's low and high nibbles; scales uint8 [...,
    N, K / 32]), and the float32 values it holds."""
    import gguf
    import numpy as np
    kind = gguf.GGMLQuantizationType.MXFP4
    raw = gguf.quants.quantize(w.float().reshape(-1, w.shape[-1]).numpy(), kind)
    values = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, kind), np.float32))
    blocks = torch.from_numpy(raw.copy()).reshape(*w.shape[:-1], -1, 17)
    nibbles = blocks[..., 1:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], -1)               # weights in order
    pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return pairs.contiguous(), blocks[..., 0].contiguous(), values.reshape(w.shape)


def _mxfp4(w, group):
    blocks, scales, values = mxfp4_pair(w)
    return {"weight_blocks": blocks, "weight_scales": scales}, values


FORMATS = {
    "gptq-v1-4bit-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                          "desc_act": False, "sym": False}, lambda w: _gptq(w, 4, 32)),
    "gptq-v2-4bit-channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False,
                              "checkpoint_format": "gptq_v2"},
                             lambda w: _gptq(w, 4, -1, v1=False)),
    "gptq-8bit-sym-g32": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": True},
                          lambda w: _gptq(w, 8, 32, sym=True)),
    "gptq-desc-act": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                       "sym": False},
                      lambda w: _gptq(w, 4, 32, perm=torch.randperm(
                          w.shape[1], generator=torch.Generator().manual_seed(w.shape[1])))),
    "awq-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                 "version": "gemm"}, lambda w: _awq(w, 32)),
    "compressed-w4a16": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                              "num_bits": 4, "type": "int", "symmetric": True,
                              "strategy": "group", "group_size": 32}}},
                          "ignore": ["lm_head"]}, lambda w: _w4a16(w, 32)),
    "compressed-w8a8": ({"quant_method": "compressed-tensors", "format": "int-quantized",
                         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                             "num_bits": 8, "type": "int", "symmetric": True,
                             "strategy": "channel"}, "input_activations": {
                             "num_bits": 8, "type": "int", "dynamic": True}}},
                         "ignore": ["lm_head"]}, lambda w: _w8a8(w, -1)),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, lambda w: _fp8(w, -1)),
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"},
                       lambda w: _fp8(w, -1, per_tensor=True)),
    "mxfp4": ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
              lambda w: _mxfp4(w, 32)),
}


def write_quantized(path: str, fmt: str) -> str:
    """Rewrite the float checkpoint at `path` in `fmt`; a float copy with the dequantized
    weights goes to path + "-float" (transformers' model)."""
    qcfg, packer = FORMATS[fmt]
    weights = load_file(os.path.join(path, "model.safetensors"))
    floats, packed = dict(weights), {}
    for name, w in weights.items():
        prefix = name[: -len(".weight")]
        if not any(prefix.endswith(lin) for lin in LINEARS):
            packed[name] = w
            continue
        tensors, values = packer(w)
        floats[name] = values.float().contiguous()
        packed.update({f"{prefix}.{k}": v for k, v in tensors.items()})
    float_dir = path + "-float"
    shutil.copytree(path, float_dir)
    save_file(floats, os.path.join(float_dir, "model.safetensors"))
    save_file(packed, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return float_dir
