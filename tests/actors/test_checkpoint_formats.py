"""Quantized Hugging Face checkpoints (actors/quant_config.py, executor/checkpoint_formats.py).

The fixtures come from pagewire.testing.checkpoints (actors/testing/checkpoints.py): each
format's packer from known integer codes (GPTQ v1 and v2, AWQ's interleaved nibbles,
compressed-tensors pack-quantized and int-quantized, FP8). Unpacking gives the codes back
exactly; a tiny model saved in each format gives transformers' greedy tokens on the same
model with the dequantized float weights, its decode steps on the blocks where the format has
them; every unsupported variant is refused at start naming its detail."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.executor import checkpoint_formats as cf
from pagewire.kernels import quant
from pagewire.quant_config import read_scheme
from pagewire.testing.checkpoints import FORMATS, write_quantized
from tests.helpers import HFOracle, assert_greedy_equal

# Formats whose codes the blocks hold: the layers' decode steps run the quantized kernels.
BLOCKS = {"gptq-v1-4bit-g32": quant.Q4_1, "gptq-v2-4bit-channel": quant.Q4_1,
          "gptq-8bit-sym-g32": quant.Q8_0, "gptq-desc-act": quant.Q4_1, "awq-g32": quant.Q4_1,
          "compressed-w4a16": quant.Q4_1, "compressed-w8a8": quant.Q8_0, "fp8": quant.FP8,
          "fp8-per-tensor": quant.FP8, "mxfp4": quant.Q8_0}   # MXFP4: where no level tiles


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not f.startswith(("fp8", "mxfp4"))])
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
    float_dir = write_quantized(path, fmt)
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=256)
    model = llm.runner.model
    if quant.available(model.ops.lib):
        kinds = {m.quantized.kind % 100 if m.quantized else None
                 for name, m in model.named_modules() if name.endswith(("qkv", "down"))}
        expected = BLOCKS.get(fmt)
        if fmt == "mxfp4" and model.ops.lib.quant_kind(quant.MXFP4):   # level tiles
            expected = quant.MXFP4
        assert kinds == {expected}, kinds
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
    write_quantized(path, "awq-g32")
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
    write_quantized(path, fmt)
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
    write_quantized(path, "gptq-desc-act")
    for kinds in rank_blocks(path):
        assert {n for n, k in kinds.items() if k == "float"} == {
            "lm_head", *(f"layers.{i}.{m}" for i in (0, 1) for m in ("attn.o_proj", "mlp.down"))
        }, kinds
