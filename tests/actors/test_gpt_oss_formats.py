"""gpt-oss from its other checkpoint formats, against transformers on the values each
holds: an MXFP4 Hugging Face directory (openai's layout: every expert stack a `_blocks` /
`_scales` pair) read through the expert mapping as floats and as stored blocks, and GGUF
files as llama.cpp's converter writes gpt-oss (F32, Q8_0, MXFP4); and the fused decode
stack against the per-op path on bfloat16 and MXFP4 checkpoints."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from pagewire import LLM
from tests.actors.test_gpt_oss import (TIGHT, VOCAB, WINDOW, bf16_copy, compare,
                                       make_gpt_oss)


@pytest.mark.parametrize("checkpoint, kv", [("bf16", "auto"), ("mxfp4", "auto"),
                                            ("bf16", "fp8")])
def test_fused_decode_equals_the_per_op_path(tmp_path, smol_tokenizer_dir, tier, checkpoint,
                                             kv):
    """bfloat16 on each tier, experts BF16 tiles or MXFP4 blocks, a bfloat16 or FP8 KV
    cache: every layer encodes (biased linears, sinks applied after the decode kernel by
    pw_apply_sinks, the MOE op with gpt-oss's block), and the stack's hidden states and KV
    writes are the per-op path's bit for bit, windows and all."""
    from tests.actors.test_fused_decode import assert_fused_equals_per_op
    path = bf16_copy(tmp_path, smol_tokenizer_dir) if checkpoint == "bf16" else \
        _mxfp4_and_reference(tmp_path, smol_tokenizer_dir)[0]
    assert_fused_equals_per_op(LLM(path, dtype="bfloat16", kernels=tier, num_kv_blocks=64,
                                   max_model_len=512, kv_cache_dtype=kv).runner, VOCAB)


def _mxfp4_and_reference(tmp_path, tokenizer_dir) -> tuple[str, str]:
    """(an MXFP4 checkpoint of the TIGHT model, as openai's are: each layer's expert stacks
    `<name>_blocks` / `_scales` pairs, quantization_config mxfp4; a float directory of the
    values those pairs hold, for transformers)."""
    import json
    from safetensors.torch import load_file, save_file
    from pagewire.testing.checkpoints import mxfp4_pair
    ref = make_gpt_oss(str(tmp_path / "ref"), tokenizer_dir, **TIGHT)
    tensors = load_file(os.path.join(ref, "model.safetensors"))
    packed = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales, values = mxfp4_pair(tensors[name].transpose(1, 2))   # [E, N, K]
        tensors[name] = values.transpose(1, 2).contiguous()                   # [E, K, N]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(ref, "model.safetensors"))
    mxfp4 = str(tmp_path / "mxfp4")
    shutil.copytree(ref, mxfp4)
    save_file({**{n: t for n, t in tensors.items() if n.replace("_proj", "_proj_blocks")
                  not in packed}, **packed}, os.path.join(mxfp4, "model.safetensors"))
    with open(os.path.join(mxfp4, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(os.path.join(mxfp4, "config.json"), "w") as f:
        json.dump(cfg, f)
    return mxfp4, ref


def test_an_mxfp4_checkpoint_reads_through_the_expert_mapping(tmp_path, smol_tokenizer_dir):
    """The MXFP4 reader (checkpoint_formats.py) gives each expert stack as transformers
    dequantizes it; gpt_oss_weights.py splits it as a bfloat16 one's: greedy tokens and
    log-probabilities as transformers' on those values (float32)."""
    from safetensors import safe_open
    mxfp4, ref = _mxfp4_and_reference(tmp_path, smol_tokenizer_dir)
    with safe_open(os.path.join(mxfp4, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.3.mlp.experts.down_proj_blocks" in names
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in names)
    llm = LLM(mxfp4, dtype="float32", kernels="torch", block_size=16,
              max_num_batched_tokens=24, num_kv_blocks=64)
    print("mxfp4", compare(llm, ref, "mxfp4"))


def test_mxfp4_experts_multiply_as_stored(tmp_path, smol_tokenizer_dir, tier):
    """On each tier every expert's Linears keep the checkpoint's MXFP4 blocks (gate_up: the
    stack's even rows then its odd ones), never a float copy; csrc/moe.cpp runs the block,
    and the tokens are transformers' on the values those blocks hold (log-probabilities
    within 3e-4: measured 6.5e-5 where the tier's products round activations to int16)."""
    mxfp4, ref = _mxfp4_and_reference(tmp_path, smol_tokenizer_dir)
    llm = LLM(mxfp4, dtype="float32", kernels=tier, block_size=16,
              max_num_batched_tokens=24, num_kv_blocks=64)
    for layer in llm.runner.model.layers:
        assert layer.mlp.native_spec is not None
        for expert in layer.mlp.experts.values():
            for linear in (expert.gate_up, expert.down):
                assert linear.weight is None and linear.quantized is not None
    print(tier, "mxfp4 as stored", compare(llm, ref, tier, bound=3e-4))


def _stacked_back(values: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """A GGUF file's tensors under Hugging Face names (each expert's gate, up and down apart;
    sinks.weight) -> gpt-oss's own layout: [E, H, 2I] gate/up interleaved, [E, I, H] down."""
    out = {n.removesuffix(".weight") if n.endswith("sinks.weight") else n: v
           for n, v in values.items() if ".experts." not in n}
    for layer in range(cfg["num_hidden_layers"]):
        src = f"model.layers.{layer}.mlp.experts."
        gate_up, gate_up_bias, down, down_bias = [], [], [], []
        for e in range(cfg["num_local_experts"]):
            def get(p, kind):
                return values[f"{src}{e}.{p}_proj.{kind}"]
            w = torch.stack([get("gate", "weight").T, get("up", "weight").T], -1)   # [H, I, 2]
            gate_up.append(w.flatten(1))                      # columns gate, up, gate, up...
            gate_up_bias.append(torch.stack([get("gate", "bias"), get("up", "bias")], -1)
                                .flatten())
            down.append(get("down", "weight").T)
            down_bias.append(get("down", "bias"))
        for name, parts in (("gate_up_proj", gate_up), ("gate_up_proj_bias", gate_up_bias),
                            ("down_proj", down), ("down_proj_bias", down_bias)):
            out[src + name] = torch.stack(parts).contiguous()
    return out


def _gguf_and_reference(tmp_path, tokenizer_dir, meta, qtype: str) -> tuple[str, str]:
    """(a GGUF file of the tiny model as llama.cpp's converter writes gpt-oss, its linears
    `qtype`; a Hugging Face directory of the values the file holds, for transformers). The
    SwiGLU's limit is gpt-oss's 7: GGUF has no key for it (llama.cpp's is fixed)."""
    import json
    from safetensors.torch import save_file
    from pagewire.executor.gguf_weights import read_gguf_weights
    from pagewire.executor.loader import read_safetensors
    from pagewire.gguf_header import read_gguf_header
    from pagewire.testing.gguf_writer import write_gguf
    hf = make_gpt_oss(str(tmp_path / "hf"), tokenizer_dir)
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    path = write_gguf(str(tmp_path / "m.gguf"), "gpt-oss", read_safetensors(hf), cfg, meta, qtype)
    values = read_gguf_weights(path, read_gguf_header(path), cfg["num_attention_heads"],
                               cfg["num_key_value_heads"])
    save_file(_stacked_back(values, cfg), os.path.join(hf, "model.safetensors"))
    return path, hf


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "MXFP4"])
def test_gguf_matches_transformers(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, qtype,
                                   tier):
    """llama.cpp's gpt-oss layout (gate and up stacked apart, sinks, biases, yarn in the
    rope.scaling keys): on each tier, the experts' blocks as stored (Q8_0, MXFP4: no float
    copy), greedy tokens and log-probabilities as transformers' on the file's values."""
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, qtype)
    llm = LLM(path, dtype="float32", kernels=tier, block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    model = llm.runner.model
    assert model.cfg.layer_windows == [WINDOW, None] * 2 and not model.cfg.stacked_experts
    if qtype != "F32":
        for layer in model.layers:
            assert layer.mlp.native_spec is not None
            for expert in layer.mlp.experts.values():
                assert expert.gate_up.weight is None and expert.down.weight is None
    # measured: 1.5e-6 (F32; every type on avx512_bf16), 2.1e-4 (Q8_0) and 2.9e-4 (MXFP4)
    # where the tier rounds activations for block products
    print(tier, qtype, "gguf", compare(llm, ref, f"{tier} {qtype}",
                                       bound=1e-4 if qtype == "F32" else 1e-3))
