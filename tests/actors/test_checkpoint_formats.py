"""Quantized Hugging Face checkpoints (actors/quant_config.py, executor/checkpoint_formats.py).

The fixtures are written here: each format's packer from known integer codes (GPTQ v1 and
v2, AWQ's interleaved nibbles, compressed-tensors pack-quantized and int-quantized, FP8).
Unpacking gives the codes back exactly; a tiny model saved in each format gives
transformers' greedy tokens on the same model with the dequantized float weights, its decode
steps on the blocks where the format has them; every unsupported variant is refused at start
naming its detail."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagewire import LLM, SamplingParams
from pagewire.executor import checkpoint_formats as cf
from pagewire.kernels import quant
from pagewire.quant_config import read_scheme
from tests.helpers import HFOracle, assert_greedy_equal

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
}
# Formats whose codes the blocks hold: the layers' decode steps run the quantized kernels.
BLOCKS = {"gptq-v1-4bit-g32": quant.Q4_1, "gptq-v2-4bit-channel": quant.Q4_1,
          "gptq-8bit-sym-g32": quant.Q8_0, "gptq-desc-act": quant.Q4_1, "awq-g32": quant.Q4_1,
          "compressed-w4a16": quant.Q4_1, "compressed-w8a8": quant.Q8_0, "fp8": quant.FP8,
          "fp8-per-tensor": quant.FP8}


def _write_quantized(path: str, fmt: str) -> str:
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


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not f.startswith("fp8")])
def test_unpacking_gives_the_codes_back(fmt):
    """Each reader returns the values the packer's codes, scales and zeros define, exactly, and
    so do the blocks made of them (these scales leave -scale * zero exact in float16)."""
    qcfg, packer = FORMATS[fmt]
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.1
    tensors, values = packer(w)
    scheme = read_scheme(qcfg, "test")
    linear = cf._READERS[scheme.packing][1](tensors, scheme)
    assert torch.equal(linear.values(), values.float())
    weight, blocks, order = cf.convert(tensors, scheme)
    assert blocks[0] == BLOCKS[fmt]
    assert torch.equal(weight, values.float())
    if fmt != "gptq-desc-act":
        assert order is None
        return
    # act-order: the blocks hold the columns sorted by group, 32 to a group
    assert torch.equal(linear.groups[order], torch.arange(96) // 32)
    assert torch.equal(cf.dequantize_rows(*blocks), values.float()[:, order])


def _prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 37)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quantized_checkpoint_matches_transformers_on_its_float_values(tiny_llama, fmt):
    path = tiny_llama()
    float_dir = _write_quantized(path, fmt)
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=256)
    model = llm.runner.model
    if quant.available(model.ops.lib):
        kinds = {m.quantized.kind % 100 if m.quantized else None
                 for name, m in model.named_modules() if name.endswith(("qkv", "down"))}
        assert kinds == ({BLOCKS[fmt]} if fmt in BLOCKS else {None}), kinds
        ordered = {name for name, m in model.named_modules()
                   if getattr(m, "quantized", None) is not None and m.quantized.order is not None}
        assert len(ordered) == (4 * 2 if fmt == "gptq-desc-act" else 0), ordered
        if fmt == "gptq-desc-act":      # the fused decode stack takes x in each one's order
            assert model.fused_decode is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    oracle = HFOracle.from_dir(float_dir)
    for prompt, out in zip(_prompts(), outs):
        theirs, logits = oracle.greedy(prompt, 10)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{fmt} {len(prompt)}")


@pytest.mark.parametrize("qcfg, detail", [
    ({"quant_method": "gptq", "bits": 3}, "bits=3"),
    ({"quant_method": "gptq", "bits": 8, "sym": False}, "sym=false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size 48"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False,
                          "strategy": "group", "group_size": 128}}}}, "symmetric=false"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}}, "nvfp4"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
])
def test_unsupported_variants_are_refused_naming_the_detail(tiny_llama, qcfg, detail):
    path = tiny_llama()
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="not supported") as err:
        LLM(path, dtype="float32", max_model_len=256)
    assert detail in str(err.value)


def test_a_quantized_checkpoint_is_not_quantized_again(tiny_llama):
    path = tiny_llama()
    _write_quantized(path, "awq-g32")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(path, dtype="float32", max_model_len=256, quantization="int4")


@pytest.mark.parametrize("fmt", ["fp8", "fp8-per-tensor"])
def test_each_rank_multiplies_its_share_of_fp8_blocks(tiny_llama, fmt, monkeypatch):
    """An FP8 checkpoint's blocks are shared among ranks as the float weights are: rows of
    qkv and gate_up, whole 32-column blocks of o_proj and down (320 intermediate rows: 160 a
    rank). The LM head is not quantized in the file, so it stays float."""
    from tests.helpers import rank_blocks
    monkeypatch.setenv("PAGEWIRE_WEIGHT_CACHE", "0")
    path = tiny_llama((128, 4, 2, 64), intermediate_size=320)
    _write_quantized(path, fmt)
    for kinds in rank_blocks(path):
        assert {n for n, k in kinds.items() if k == "float"} == {"lm_head"}, kinds


def test_each_rank_takes_its_rows_of_act_order_blocks(tiny_llama, monkeypatch):
    """GPTQ act-order: qkv and gate_up keep the checkpoint's column order and split by rows,
    so each rank multiplies its rows' blocks in that order; o_proj and down would cut their
    columns across the order, so their float shares serve them (and the unquantized LM
    head)."""
    from tests.helpers import rank_blocks
    monkeypatch.setenv("PAGEWIRE_WEIGHT_CACHE", "0")
    path = tiny_llama((128, 4, 2, 64), intermediate_size=320)
    _write_quantized(path, "gptq-desc-act")
    for kinds in rank_blocks(path):
        assert {n for n, k in kinds.items() if k == "float"} == {
            "lm_head", *(f"layers.{i}.{m}" for i in (0, 1) for m in ("attn.o_proj", "mlp.down"))
        }, kinds
