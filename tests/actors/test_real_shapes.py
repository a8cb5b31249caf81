"""Random-weight models of real shapes (actors/testing/real_shapes.py), written tiny: each
format's file holds exactly the planned tensors in the intended types, is found whole (and a
cut one is not), and the engine generates valid tokens from finite logits on it."""
from __future__ import annotations

import math
import os

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.executor.gguf_weights import read_gguf_weights
from pagewire.gguf_header import GGML_TYPES, read_gguf_header
from pagewire.model_info import resolve_model
from pagewire.testing.real_shapes import (SHAPES, default_tokenizer_meta, gguf_is_whole,
                                          tensor_plan, write_gguf_model)
from pagewire.testing.real_shapes_hf import hf_is_whole, write_hf_model
from tests.helpers import use_private_cache

TINY = dict(architecture="LlamaForCausalLM", hidden_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
            tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY_QWEN = {**TINY, "architecture": "Qwen2ForCausalLM", "tie_word_embeddings": True}
TINY_OLMOE = {**TINY, "architecture": "OlmoeForCausalLM", "num_key_value_heads": 4,
              "num_experts": 4, "num_experts_per_tok": 2}
TINY_NEOX = {**TINY, "architecture": "GPTNeoXForCausalLM", "num_key_value_heads": 4,
             "rotary_pct": 0.25, "use_parallel_residual": True, "layer_norm_eps": 1e-5}
TINY_GPT_OSS = dict(architecture="GptOssForCausalLM", hidden_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=16, tie_word_embeddings=False, rope_theta=150000.0,
                    rms_norm_eps=1e-5, rope_parameters=dict(
                        rope_type="yarn", factor=32.0, rope_theta=150000.0,
                        original_max_position_embeddings=4096))
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer_meta() -> dict:
    return default_tokenizer_meta(VOCAB)


def _types(path: str) -> dict[str, str]:
    return {n: GGML_TYPES[t.ggml_type][0] for n, t in read_gguf_header(path).tensors.items()}


def test_q4_k_m_types_are_llama_cpp_mix(tmp_path, tokenizer_meta):
    path = write_gguf_model(str(tmp_path / "m.gguf"), TINY, "Q4_K_M", tokenizer_meta)
    types = _types(path)
    assert len(types) == 1 + 2 * 9 + 2
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["output_norm.weight"] == "F32"
    for i in range(2):
        assert types[f"blk.{i}.ffn_down.weight"] == "Q6_K"
        assert types[f"blk.{i}.attn_v.weight"] == ("Q6_K" if i == 0 else "Q4_K")
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == types[f"blk.{i}.ffn_norm.weight"] == "F32"


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0"])
def test_plain_formats_store_every_matrix_in_their_type(tmp_path, tokenizer_meta, fmt):
    path = write_gguf_model(str(tmp_path / "m.gguf"), TINY_QWEN, fmt, tokenizer_meta)
    types = _types(path)
    assert "output.weight" not in types            # tied
    assert types["blk.1.attn_k.bias"] == "F32"
    header = read_gguf_header(path).tensors
    assert header["blk.0.attn_k.weight"].shape == (2 * 64, 256)
    assert {t for n, t in types.items() if n.endswith(".weight") and "norm" not in n} == {fmt}


def test_iq4_xs_keeps_the_embedding_and_head_in_q6_k(tmp_path, tokenizer_meta):
    path = write_gguf_model(str(tmp_path / "m.gguf"), TINY, "IQ4_XS", tokenizer_meta)
    types = _types(path)
    assert types["token_embd.weight"] == types["output.weight"] == "Q6_K"
    assert {t for n, t in types.items() if n.startswith("blk.") and n.endswith(".weight")
            and "norm" not in n} == {"IQ4_XS"}


def test_weights_are_small_and_norms_ones(tmp_path, tokenizer_meta):
    for fmt in ("Q4_0", "Q4_K_M", "Q5_K_M", "Q8_0", "IQ4_XS"):
        path = write_gguf_model(str(tmp_path / f"{fmt}.gguf"), TINY, fmt, tokenizer_meta)
        weights = read_gguf_weights(path, read_gguf_header(path), 4, 2)
        for name, w in weights.items():
            if name.endswith("norm.weight"):
                assert torch.equal(w, torch.ones_like(w)), name
            else:
                rms = float(w.pow(2).mean().sqrt())
                assert 0.005 < rms < 0.06, (fmt, name, rms)


def test_gpt_oss_is_written_as_ggml_orgs_mxfp4_file(tmp_path, tokenizer_meta):
    """Experts MXFP4, the other linears and the embedding Q8_0, biases, sinks and routers
    float32; weights small (E8M0 exponents 119-121); MXFP4 only."""
    path = write_gguf_model(str(tmp_path / "m.gguf"), TINY_GPT_OSS, "MXFP4", tokenizer_meta)
    types = _types(path)
    assert len(types) == 3 + 2 * 19
    for i in range(2):
        for proj in ("gate", "up", "down"):
            assert types[f"blk.{i}.ffn_{proj}_exps.weight"] == "MXFP4"
            assert types[f"blk.{i}.ffn_{proj}_exps.bias"] == "F32"
        for proj in ("q", "k", "v", "output"):
            assert types[f"blk.{i}.attn_{proj}.weight"] == "Q8_0"
        assert types[f"blk.{i}.attn_sinks.weight"] == types[f"blk.{i}.ffn_gate_inp.weight"] \
            == "F32"
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"
    header = read_gguf_header(path)
    assert header.tensors["blk.0.ffn_down_exps.weight"].shape == (4, 256, 256)
    assert header.tensors["blk.0.attn_q.weight"].shape == (4 * 64, 256)
    assert header.metadata["gpt-oss.attention.sliding_window"] == 16
    weights = read_gguf_weights(path, header, 4, 2)
    experts = [w for n, w in weights.items() if "experts" in n and n.endswith("weight")]
    assert experts and all(0.005 < float(w.pow(2).mean().sqrt()) < 0.06 for w in experts)
    with pytest.raises(ValueError, match="MXFP4"):
        tensor_plan(TINY_GPT_OSS, "Q4_0", VOCAB)


def test_whole_files_are_found_and_cut_ones_are_not(tmp_path, tokenizer_meta):
    path = write_gguf_model(str(tmp_path / "m.gguf"), TINY, "Q4_0", tokenizer_meta)
    assert gguf_is_whole(path, TINY, "Q4_0")
    assert not gguf_is_whole(path, TINY, "Q8_0")
    assert not gguf_is_whole(path, {**TINY, "num_hidden_layers": 3}, "Q4_0")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    assert not gguf_is_whole(path, TINY, "Q4_0")
    assert not os.path.exists(path + ".part")


def test_real_shapes_sizes():
    """llama-3.1-8b: 7.38B weights with the 49,152-token vocabulary (untied; 8.03B with its
    own 128,256)."""
    plan = tensor_plan(SHAPES["llama-3.1-8b"], "bf16", 49152)
    assert sum(math.prod(t.dims) for t in plan) == 7_382_241_280
    q4km = tensor_plan(SHAPES["llama-3.1-8b"], "Q4_K_M", 49152)
    assert {t.ggml_type for t in q4km} == {"Q4_K", "Q6_K", "F32"}


def _generate(path: str) -> None:
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=16)
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 20))}],
                          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                         logprobs=1))
    vocab = resolve_model(path).vocab_size
    got = out.outputs[0]
    assert len(got.token_ids) == 4 and all(0 <= t < vocab for t in got.token_ids)
    assert all(math.isfinite(step.top[0][2]) for step in got.logprobs)


@pytest.mark.parametrize("fmt,shape", [("Q4_0", TINY), ("Q4_K_M", TINY_QWEN),
                                       ("Q8_0", TINY), ("Q4_K_M", TINY_OLMOE),
                                       ("Q4_K_M", TINY_NEOX), ("MXFP4", TINY_GPT_OSS),
                                       ("IQ4_XS", TINY), ("Q5_K_M", TINY)],
                         ids=["llama-Q4_0", "qwen-Q4_K_M", "llama-Q8_0", "olmoe", "gpt-neox",
                              "gpt-oss", "llama-IQ4_XS", "llama-Q5_K_M"])
def test_engine_generates_from_gguf(tmp_path, monkeypatch, tokenizer_meta, fmt, shape):
    use_private_cache(tmp_path, monkeypatch)
    _generate(write_gguf_model(str(tmp_path / "m.gguf"), shape, fmt, tokenizer_meta))


def test_engine_generates_from_bf16_directory(tmp_path, monkeypatch, smol_tokenizer_dir):
    use_private_cache(tmp_path, monkeypatch)
    path = write_hf_model(str(tmp_path / "m-bf16"), TINY_QWEN, smol_tokenizer_dir,
                          shard_bytes=4 * 2**20)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    assert hf_is_whole(path, TINY_QWEN) is False          # written with other shards
    write_hf_model(path, TINY_QWEN, smol_tokenizer_dir)
    assert hf_is_whole(path, TINY_QWEN)
    _generate(path)
