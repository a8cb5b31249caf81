"""The GPT family from GGUF files written as llama.cpp's converter writes them: GPT-NeoX
(`gptneox`: LayerNorms with biases, its head-by-head fused QKV, rope on a quarter of each head,
parallel residual or not), GPT-2 (`gpt2`: its Conv1D weights stored transposed), Phi-2
(`phi2`: q, k and v apart, or fused as older files have them; an LM head with a bias) and
Starcoder2 (`starcoder2`) give transformers' greedy tokens on the file's values, their linears
multiplying the file's blocks. (Hugging Face directories: test_architectures.py.)"""
from __future__ import annotations

import pytest
import torch

from pagewire import LLM
from pagewire.kernels.linear import Linear
from tests.actors.test_moe_models import _check_greedy, _gguf_and_reference
from tests.actors.test_moe_models import private_cache  # noqa: F401 (autouse: a private cache)


@pytest.mark.parametrize("name, qtype", [("gpt-neox-parallel", "Q8_0"),
                                         ("gpt-neox-sequential", "F32")])
def test_gpt_neox_gguf_matches_transformers(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                            name, qtype):
    """Q8_0: every linear multiplies the file's blocks, QKV's rows reordered as the float
    weights' are (head by head in the file)."""
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                    (name, "gptneox", qtype, {}))
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    model = llm.runner.model
    assert model.cfg.architecture == "GPTNeoXForCausalLM"
    blocks = [m.quantized is not None for m in model.modules() if isinstance(m, Linear)]
    assert all(blocks) if qtype == "Q8_0" else not any(blocks)
    assert (model.fused_decode is not None) == (qtype == "Q8_0")    # its ops all native
    _check_greedy(llm, ref, f"{name} {qtype}")


def _phi_fused_qkv(state: dict) -> dict:
    """Phi-2's q, k and v as one tensor per layer (the original checkpoint's mixer.Wqkv)."""
    out = {}
    for name, w in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            layer, kind = name.split(".")[2], name.rsplit(".", 1)[1]
            name, w = f"transformer.h.{layer}.mixer.Wqkv.{kind}", torch.cat(parts)
        out[name] = w
    return out


@pytest.mark.parametrize("name, arch, qtype, fuse", [
    ("gpt2", "gpt2", "Q8_0", None), ("gpt2", "gpt2", "F32", None),
    ("phi-2", "phi2", "Q8_0", None), ("phi-2", "phi2", "Q4_0", _phi_fused_qkv),
    ("phi-2", "phi2", "F32", _phi_fused_qkv), ("starcoder2", "starcoder2", "Q8_0", None)])
def test_gpt_family_gguf_matches_transformers(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                              name, arch, qtype, fuse):
    """The file's blocks multiply as stored (GPT-2's rows already [out, in]; Phi-2's fused
    QKV cut into q, k and v rows), its float values in Hugging Face's layout otherwise."""
    overrides = dict(sliding_window=None) if arch == "starcoder2" else {}   # llama.cpp has none
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                    (name, arch, qtype, overrides), fuse)
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    blocks = [m.quantized is not None for m in llm.runner.model.modules()
              if isinstance(m, Linear)]
    assert all(blocks) if qtype != "F32" else not any(blocks)
    assert (llm.runner.model.fused_decode is not None) == (qtype != "F32")
    _check_greedy(llm, ref, f"{name} {arch} {qtype}")


def _gpt_neox_greedy(tmp_path, tokenizer_dir, meta, kernels: str) -> None:
    path, ref = _gguf_and_reference(tmp_path, tokenizer_dir, meta,
                                    ("gpt-neox-parallel", "gptneox", "Q8_0", {}))
    llm = LLM(path, dtype="float32", kernels=kernels, block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    assert (llm.runner.model.fused_decode is not None) == (kernels != "torch")
    _check_greedy(llm, ref, f"gpt-neox {kernels}")


def test_gpt_neox_on_each_tier(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, tier):
    """Every tier's native LayerNorm, exact GELU, partial rope and parallel residual, in its
    fused decode, give transformers' greedy tokens."""
    _gpt_neox_greedy(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, tier)


def test_gpt_neox_on_the_torch_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta):
    _gpt_neox_greedy(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, "torch")
