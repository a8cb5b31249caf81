"""LoRA adapters of the attention on the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, gpt-oss) and on Phi-2 and Starcoder2: a batch mixing the base model and an adapter gives
each request transformers' greedy tokens on its merged weights, through the native MoE blocks
and the fused decode stack; an adapter of their experts, router or plain MLP is refused by
name, and the GPT-family blocks that take none refuse --enable-lora."""
from __future__ import annotations

import os

import pytest
import torch

from pagewire import LLM, LoRARequest, SamplingParams
from pagewire.lora_files import InvalidAdapter, projection_shapes, read_adapter
from pagewire.model_info import resolve_model
from tests.actors.test_architectures import make_model
from tests.actors.test_lora import merged_oracle
from tests.helpers import assert_greedy_equal

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 45)), [100, 101, 100, 101, 7]]
# test_architectures' configs; Phi-2 names its attention's output `dense`
FAMILIES = {"mixtral-moe": ATTN, "qwen2-moe-shared": ATTN, "qwen3-moe": ATTN, "olmoe": ATTN,
            "gpt-oss": ATTN, "phi-2": ("q_proj", "k_proj", "v_proj", "dense"),
            "starcoder2": ATTN}


def attention_adapter(path: str, base: str, names, rank: int = 4, seed: int = 0,
                      extra: dict | None = None) -> str:
    """A PEFT adapter of every layer's attention projections `names` (the file's names),
    random A and B; `extra`: more tensors, {name: shape}."""
    import json

    from safetensors.torch import save_file
    info = resolve_model(base)
    shapes = projection_shapes(info)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": list(names)}, f)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(info.num_layers):
        for name in names:
            out, inp = shapes["o_proj" if name == "dense" else name]
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.3
            weights[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    weights.update({k: torch.zeros(shape) for k, shape in (extra or {}).items()})
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_adapters_give_the_merged_models_tokens(tmp_path, smol_tokenizer_dir, family):
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, family)
    adapter = attention_adapter(str(tmp_path / "adapter"), base, FAMILIES[family])
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    request = LoRARequest("attn", 1, adapter)
    cases = [(p, lora) for p in PROMPTS for lora in (None, request)]    # both in every step
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], params,
                        lora_request=[lora for _, lora in cases])
    oracles = {None: merged_oracle(base, None), request: merged_oracle(base, adapter)}
    differs = 0
    for (prompt, lora), out in zip(cases, outs):
        theirs, logits = oracles[lora].greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits,
                            f"{family}, adapter {lora is not None}, prompt {len(prompt)}")
        differs += lora is not None and theirs != oracles[None].greedy(prompt, 8)[0]
    assert differs                                                      # the adapter matters
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks


@pytest.mark.parametrize("family, tensor, why", [
    ("mixtral-moe", "block_sparse_moe.experts.0.w1", "experts and router take none yet"),
    ("qwen2-moe-shared", "mlp.gate_proj", "experts and router take none yet"),
    ("starcoder2", "mlp.c_fc", "its MLP takes none yet")])
def test_adapters_of_experts_or_plain_mlps_are_refused_by_name(tmp_path, smol_tokenizer_dir,
                                                               family, tensor, why):
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, family)
    name = f"base_model.model.model.layers.0.{tensor}.lora_A.weight"
    adapter = attention_adapter(str(tmp_path / "adapter"), base, ("q_proj",),
                                extra={name: (4, 64)})
    with pytest.raises(InvalidAdapter, match=f"tensor {name} is not a LoRA A or B of q/k/v/o "
                                             f"\\(embeddings, LM head, biases: not supported; .*{why}"):
        read_adapter(adapter, resolve_model(base), 16)


def test_gpt_blocks_with_reordered_or_conv1d_projections_refuse_lora(tmp_path,
                                                                     smol_tokenizer_dir):
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, "gpt-neox-parallel")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM with --enable-lora is not"):
        LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True)


def test_an_attention_adapter_on_gguf_experts_through_the_fused_decode(
        tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta):
    """OLMoE's GGUF (Q8_0): native MoE blocks and the fused decode stack (its LINEAR ops
    apply the adapter's delta) give the merged reference's tokens."""
    from tests.actors.test_moe_models import _gguf_and_reference
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                    "olmoe-Q8_0")
    adapter = attention_adapter(str(tmp_path / "adapter"), ref, ATTN, seed=3)
    llm = LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_lora=True, max_loras=1)
    assert llm.runner.model.fused_decode is not None
    request = LoRARequest("attn", 1, adapter)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                        lora_request=[request] * len(PROMPTS))
    oracle, base = merged_oracle(ref, adapter), merged_oracle(ref, None)
    differs = 0
    for prompt, out in zip(PROMPTS, outs):
        theirs, logits = oracle.greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"prompt {len(prompt)}")
        differs += theirs != base.greedy(prompt, 8)[0]
    assert differs
