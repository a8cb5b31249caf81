"""MXFP4 weights (gpt-oss's experts' format) in a whole model: a tiny Llama whose linears a
GGUF file stores as MXFP4 (gguf-py quantizes them) runs on every native CPU tier from the
file's blocks (as level tiles) and on the torch reference (dequantized), greedy-equal to
transformers on the same file (its own dequantization of it)."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.kernels import quant, tiers
from pagewire.kernels.linear import Linear
from pagewire.testing.gguf_writer import write_gguf
from pagewire.testing.real_shapes import cut_tokenizer
from tests.helpers import HFOracle, assert_greedy_equal, use_private_cache

gguf = pytest.importorskip("gguf")
VOCAB = 512


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    use_private_cache(tmp_path, monkeypatch)


@pytest.mark.parametrize("kernels", ["torch", *tiers.TIERS])
def test_an_mxfp4_llama_gguf_matches_transformers_on_every_backend(
        tiny_llama, tmp_path, gguf_tokenizer_meta, kernels):
    from transformers import AutoModelForCausalLM
    if kernels != "torch" and kernels not in tiers.runnable():
        pytest.skip(f"this CPU does not run the {kernels} tier")
    hf_dir = tiny_llama("gqa2-d128", intermediate_size=512)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    state = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    path = write_gguf(str(tmp_path / "mx.gguf"), "llama", state, cfg,
                      cut_tokenizer(gguf_tokenizer_meta, VOCAB), "MXFP4")
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=256, kernels=kernels,
              quantized_matmul_tokens=-1)
    kinds = {s.kind % 100 for m in llm.runner.model.modules() if isinstance(m, Linear)
             and m.quantized is not None for s in m.quantized.segments}
    # every linear's blocks as level tiles, however the tier's default rounds activations
    assert kinds == (set() if kernels == "torch" else {quant.MXFP4})
    oracle = HFOracle(AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="mx.gguf",
                                                           dtype=torch.float32))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 33)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{kernels} {len(prompt)}")


def test_mxfp4_experts_multiply_as_stored_and_match_transformers(tmp_path, smol_tokenizer_dir,
                                                                 gguf_tokenizer_meta):
    """An OLMoE GGUF whose experts (stacked [E, rows, cols]) are MXFP4, as gpt-oss's: every
    expert's Linear holds its slice's blocks only (as level tiles, no float copy), and
    greedy tokens equal transformers' on the values the file holds (our dequantization of it)."""
    from safetensors.torch import save_file
    from pagewire.executor.gguf_weights import read_gguf_weights
    from pagewire.executor.loader import read_safetensors
    from pagewire.executor.models.moe import SparseMoE
    from pagewire.gguf_header import read_gguf_header
    from tests.actors.test_architectures import make_model
    hf_dir = make_model(str(tmp_path / "hf"), smol_tokenizer_dir, "olmoe")
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    path = write_gguf(str(tmp_path / "m.gguf"), "olmoe", read_safetensors(hf_dir), cfg,
                      gguf_tokenizer_meta, "MXFP4")
    values = read_gguf_weights(path, read_gguf_header(path), cfg["num_attention_heads"],
                               cfg["num_key_value_heads"])
    save_file({k: v.contiguous() for k, v in values.items()},
              os.path.join(hf_dir, "model.safetensors"))
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24, num_kv_blocks=64)
    experts = [e for m in llm.runner.model.modules() if isinstance(m, SparseMoE)
               for e in m.experts.values()]
    assert len(experts) == cfg["num_hidden_layers"] * cfg["num_experts"]
    for linear in (lin for e in experts for lin in (e.gate_up, e.down)):
        assert linear.weight is None and linear.quantized.kind % 100 == quant.MXFP4
    oracle = HFOracle.from_dir(hf_dir)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"olmoe {len(prompt)}")


# Hugging Face's MXFP4 (gpt-oss's quantization_config {"quant_method": "mxfp4"}): each
# `<name>_blocks` / `<name>_scales` pair, checked against transformers' own dequantization.
GPT_OSS_QCFG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _pair(experts: int, rows: int, cols: int, seed: int, exponents=(0, 256)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                           generator=g)
    scales = torch.randint(*exponents, (experts, rows, cols // 32), generator=g)
    return blocks, scales.to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hf_mxfp4_pairs_dequantize_as_transformers_does(dtype):
    """Every scale byte (0..255) and every code: bit for bit transformers'
    convert_moe_packed_tensors, [E, K, N] as gpt-oss's experts hold them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from pagewire.executor import checkpoint_formats as cf
    blocks, _ = _pair(2, 256, 128, 0)
    scales = torch.arange(256, dtype=torch.uint8)[None, :, None].expand(2, 256, 4).contiguous()
    ours = cf.mxfp4_values(blocks, scales, dtype)
    assert ours.shape == (2, 128, 256) and ours.dtype == dtype
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_an_mxfp4_checkpoint_reads_as_its_values_or_its_blocks(native_lib):
    """The scheme is read; float_weights gives `<name>` as transformers dequantizes it (the
    pair gone, the other tensors cast); blocks_by_name the GGML MXFP4 blocks of a stack of
    experts, which each multiply (as level or Q8_0 tiles) within float32 rounding of x @ W[e]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from pagewire.executor import checkpoint_formats as cf
    from pagewire.quant_config import read_scheme
    scheme = read_scheme(GPT_OSS_QCFG, "test")
    assert scheme.packing == "mxfp4"
    blocks, scales = _pair(2, 48, 96, 1, exponents=(118, 128))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    bias = torch.randn(2, 48)
    weights = {name + "_blocks": blocks, name + "_scales": scales, name + "_bias": bias}
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)   # [2, 96, 48]
    floats = cf.float_weights(weights, scheme, torch.float32)
    assert set(floats) == {name, name + "_bias"}
    assert torch.equal(floats[name], expected) and torch.equal(floats[name + "_bias"], bias)
    assert set(cf.float_weights(weights, scheme, torch.float32, frozenset({name}))) == \
        {name + "_bias"}
    stored, orders = cf.blocks_by_name(weights, scheme)
    (kind, raw), = stored.values()
    assert list(stored) == [name] and orders == {} and kind == quant.MXFP4
    assert raw.shape == (2, 48, 96 // 32 * 17)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    for e in range(2):
        w = expected[e].T.double()                                               # [N, K]
        out = quant.matmul(x, quant.pack(kind, raw[e], 96, native_lib))
        bound = (x.double().abs() @ w.abs().T) * 96 * 2.0 ** -24
        assert ((out.double() - x.double() @ w.T).abs() <= bound).all()


def test_mxfp4_pairs_of_other_shapes_are_refused():
    from pagewire.executor import checkpoint_formats as cf
    blocks, scales = _pair(1, 16, 64, 3)
    with pytest.raises(ValueError, match="MXFP4 blocks must be uint8"):
        cf.mxfp4_as_gguf(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="MXFP4 blocks must be uint8"):
        cf.mxfp4_as_gguf(blocks, scales.int())


def test_a_2d_pair_reads_as_a_linear_weight_and_its_blocks_are_the_ggml_ones():
    """pagewire.testing's writer (gguf-py's rounding, Hugging Face's layout) round trip:
    transformers reads the pair (as a stack of one) as the values gguf-py's blocks hold;
    ours gives those values as [N, K] and those very blocks back."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from pagewire.executor import checkpoint_formats as cf
    from pagewire.testing.checkpoints import mxfp4_pair
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(5)) * 0.1
    blocks, scales, values = mxfp4_pair(w)
    assert blocks.shape == (48, 4, 16) and scales.shape == (48, 4)
    theirs = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0]
    assert torch.equal(theirs.T, values)
    assert torch.equal(cf.mxfp4_values(blocks, scales, torch.float32), values)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(cf.mxfp4_as_gguf(blocks, scales), torch.from_numpy(raw.copy()))
