"""Every supported architecture against transformers on a tiny random-weight model: greedy
tokens equal (logits close in float32), over prompts longer than the sliding windows, with
chunked prefill so cached context, windows and soft-capping meet in one step."""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from pagewire import LLM, SamplingParams
from tests.helpers import HFOracle, assert_greedy_equal

VOCAB = 512
WINDOW = 16      # far below the prompts: the window decides what a token sees
COMMON = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _configs():
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, GPT2Config,
                              GPTJConfig, GptOssConfig,
                              GPTNeoXConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, OlmoeConfig, Phi3Config, PhiConfig, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, Starcoder2Config)
    return {
        "llama3-rope": (LlamaConfig, "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
        "mistral-window": (MistralConfig, "MistralForCausalLM", dict(sliding_window=WINDOW)),
        "qwen2-bias": (Qwen2Config, "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
        "qwen3-qknorm": (Qwen3Config, "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
        "phi3-fused": (Phi3Config, "Phi3ForCausalLM", dict(sliding_window=WINDOW,
                                                           tie_word_embeddings=False)),
        "gemma-gelu": (GemmaConfig, "GemmaForCausalLM", dict(hidden_activation="gelu_pytorch_tanh")),
        "gemma2-softcap": (Gemma2Config, "Gemma2ForCausalLM", dict(
            sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")),
        "gemma3-local-global": (Gemma3TextConfig, "Gemma3ForCausalLM", dict(
            sliding_window=WINDOW, query_pre_attn_scalar=24, num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
        # Mixtures of experts: top-k renormalised (Mixtral), a gated shared expert and a dense
        # layer among sparse ones (Qwen2-MoE), q/k norms per head (Qwen3-MoE) and over all
        # heads (OLMoE, which takes head_dim as hidden / heads).
        "mixtral-moe": (MixtralConfig, "MixtralForCausalLM", dict(
            num_local_experts=6, num_experts_per_tok=2, sliding_window=WINDOW)),
        "qwen2-moe-shared": (Qwen2MoeConfig, "Qwen2MoeForCausalLM", dict(
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=96, mlp_only_layers=[1])),
        "qwen3-moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", dict(
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True)),
        "olmoe": (OlmoeConfig, "OlmoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2,
                                                        hidden_size=128)),
        # gpt-oss: sinks, sliding/full layers, yarn, biases everywhere, top-k then softmax,
        # the clamped SwiGLU (more in test_gpt_oss.py).
        "gpt-oss": (GptOssConfig, "GptOssForCausalLM", dict(
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
            sliding_window=WINDOW, rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                "original_max_position_embeddings": 128, "truncate": False})),
        # The GPT family: LayerNorms, plain GELU MLPs with biases; GPT-NeoX's parallel
        # residual (or not) and rope on a quarter (a half) of each head; GPT-2's learned
        # positions and Conv1D weights. Multi-head attention, head_dim hidden / heads.
        "gpt-neox-parallel": (GPTNeoXConfig, "GPTNeoXForCausalLM", dict(
            hidden_size=128, rotary_pct=0.25)),
        "gpt-neox-sequential": (GPTNeoXConfig, "GPTNeoXForCausalLM", dict(
            hidden_size=128, rotary_pct=0.5, use_parallel_residual=False)),
        "gpt2": (GPT2Config, "GPT2LMHeadModel", dict(n_embd=128, n_layer=3, n_head=4,
                                                     n_positions=512)),
        # GPT-J: interleaved rope on half of each head, one norm for a parallel block, an
        # LM head with a bias; Phi-2: rotate-half on half of each head, grouped-query, the
        # same block and head; Starcoder2: sequential LayerNorm blocks, a sliding window.
        "gptj": (GPTJConfig, "GPTJForCausalLM", dict(hidden_size=128, n_head=4, n_layer=3,
                                                    rotary_dim=16, n_positions=512)),
        "phi-2": (PhiConfig, "PhiForCausalLM", dict(hidden_size=128, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
        "starcoder2": (Starcoder2Config, "Starcoder2ForCausalLM", dict(
            hidden_size=128, sliding_window=WINDOW, norm_epsilon=1e-5)),
    }


def make_model(path: str, tokenizer_dir: str, name: str, **overrides) -> str:
    import transformers
    config_cls, arch, extra = _configs()[name]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(1)
    model = getattr(transformers, arch)(config).float()
    gemma = arch.startswith("Gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif ("norm" in pname or ".ln_" in pname) and pname.endswith("weight"):
                p.normal_(0.0 if gemma else 1.0, 0.1)   # Gemma's multiply by 1 + weight
            else:
                p.normal_(0, 0.08)           # biases
    model.save_pretrained(path, safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


@pytest.mark.parametrize("name", sorted(_configs()))
def test_greedy_matches_transformers(tmp_path, smol_tokenizer_dir, name):
    path = make_model(str(tmp_path / name), smol_tokenizer_dir, name)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 37, 70)]
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = HFOracle.from_dir(path)
    for prompt, out in zip(prompts, outputs):
        theirs, logits = oracle.greedy(prompt, 12)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{name}, prompt {len(prompt)}")


@pytest.mark.parametrize("name", ["gemma2-softcap", "qwen2-bias", "gpt-neox-parallel", "gpt2",
                                  "gptj", "phi-2"])
def test_logits_close_to_transformers(tmp_path, smol_tokenizer_dir, name):
    """The whole prompt's last logits, float32 on both sides."""
    path = make_model(str(tmp_path / name), smol_tokenizer_dir, name)
    prompt = list(range(3, 60))
    llm = LLM(path, dtype="float32", num_kv_blocks=32)
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    oracle = HFOracle.from_dir(path)
    with torch.no_grad():
        theirs = torch.log_softmax(oracle.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    first = out.outputs[0].logprobs[0]
    assert first.token_id == int(theirs.argmax()) and len(first.top) == 5
    for token_id, _, logprob in first.top:
        assert abs(logprob - float(theirs[token_id])) < 1e-4
