"""gpt-oss (GptOssForCausalLM) from a bfloat16-style safetensors directory against
transformers on tiny random configs: attention sinks, alternating sliding (window 4, far
below the prompts) and full layers, yarn rope, biases on q/k/v/o, the router and the
experts, top-k-then-softmax routing and the clamped SwiGLU (a limit small enough that the
clamps bite). Greedy tokens equal; each step's top-20 log-probabilities within a stated
bound of transformers' (float32 both sides), on the torch reference and the native CPU
backend (its decode with the sinks applied after its kernel, torch for the rest)."""
from __future__ import annotations

import os
import random
import re
import shutil

import pytest
import torch

from pagewire import LLM, SamplingParams
from tests.helpers import HFOracle, assert_greedy_equal

VOCAB = 512
WINDOW = 4
# float32 on both sides; what two summation orders leave of the log-probabilities
LOGPROB_BOUND = 1e-4
TIGHT = dict(swiglu_limit=0.4)        # the clamps of gate and up take effect at this limit


def oracle_reads_the_limit() -> bool:
    """Whether transformers' gpt-oss experts take swiglu_limit from the config: releases before
    5.2x fix it at 7.0 (and alpha at 1.702), so a TIGHT model has no oracle there."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    config = GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=2, **TIGHT)
    return GptOssExperts(config).limit == TIGHT["swiglu_limit"]


def make_gpt_oss(path: str, tokenizer_dir: str, **overrides) -> str:
    from transformers import GptOssConfig, GptOssForCausalLM
    if overrides.get("swiglu_limit", 7.0) != 7.0 and not oracle_reads_the_limit():
        pytest.skip("this transformers fixes gpt-oss's SwiGLU limit at 7.0: no oracle for "
                    "another limit")
    config = GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 128}), **overrides})
    torch.manual_seed(2)
    model = GptOssForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.5)                     # a share of every row's mass, varied
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.08)                    # weights, stacked experts, biases
    model.save_pretrained(path, safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 37, 70)]


def compare(llm: LLM, path: str, label: str, steps: int = 10,
            bound: float = LOGPROB_BOUND) -> float:
    """Greedy tokens equal transformers'; returns the largest difference of a top-20
    log-probability over every prompt and step compared (asserted within `bound`)."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle, worst = HFOracle.from_dir(path), 0.0
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, steps)
        ours = out.outputs[0].token_ids
        assert_greedy_equal(ours, theirs, logits, f"{label}, prompt {len(prompt)}")
        for i, (step, step_logits) in enumerate(zip(out.outputs[0].logprobs, logits)):
            if ours[:i] != theirs[:i]:
                break
            reference = torch.log_softmax(step_logits, -1)
            for token_id, _, logprob in step.top:
                worst = max(worst, abs(logprob - float(reference[token_id])))
    assert worst < bound, f"{label}: log-probabilities {worst:.3g} from transformers'"
    return worst


@pytest.mark.parametrize("overrides", [{}, TIGHT], ids=["limit-7", "limit-0.4"])
def test_greedy_and_logprobs_match_transformers_on_torch(tmp_path, smol_tokenizer_dir,
                                                         overrides):
    """Chunked prefill (24 tokens a step) so cached context, windows and sinks meet in one
    step; decode steps after."""
    path = make_gpt_oss(str(tmp_path / "m"), smol_tokenizer_dir, **overrides)
    llm = LLM(path, dtype="float32", kernels="torch", block_size=16,
              max_num_batched_tokens=24, num_kv_blocks=64)
    model = llm.runner.model
    assert [layer.attn.variant.window for layer in model.layers] == [WINDOW, None] * 2
    assert all(layer.attn.variant.sinks is not None for layer in model.layers)
    print("torch", overrides, compare(llm, path, "torch"))


def test_cpu_backend_matches_transformers(tmp_path, smol_tokenizer_dir, tier, monkeypatch):
    """Each native tier, float32: the native decode kernel with the sinks applied to its rows,
    the experts (float32 weights, not tiles) through torch's grouping over the tier's linears,
    and so no fused decode."""
    from pagewire.kernels import native
    applied = []
    monkeypatch.setattr(native.Library, "apply_sinks_", lambda self, *a, f=native.Library.
                        apply_sinks_: applied.append(1) or f(self, *a))
    path = make_gpt_oss(str(tmp_path / "m"), smol_tokenizer_dir, **TIGHT)
    llm = LLM(path, dtype="float32", kernels=tier, block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    model = llm.runner.model
    assert model.fused_decode is None
    assert all(layer.mlp.native_spec is None for layer in model.layers)
    print(tier, compare(llm, path, tier))
    assert applied                   # the decode rows: the native kernel, then pw_apply_sinks


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_bfloat16_checkpoint_stays_close_to_transformers(tmp_path, smol_tokenizer_dir, kernels):
    """A bfloat16 checkpoint (as gpt-oss's unquantized ones are) run in bfloat16 (on the CPU
    backend its experts BF16 tiles that csrc/moe.cpp runs, biases and all): the first
    token's top log-probabilities within 0.03 of transformers' on the same values, in float32
    or in bfloat16 (measured: <= 0.009). Either: a router's near-tie may flip under bfloat16
    rounding, and did for one prompt here (transformers' two runs 0.25 apart; ours matched
    one of them within 0.008)."""
    from transformers import AutoModelForCausalLM
    bf16 = bf16_copy(tmp_path, smol_tokenizer_dir)
    llm = LLM(bf16, dtype="bfloat16", kernels=kernels, num_kv_blocks=64)
    blocks = [layer.mlp for layer in llm.runner.model.layers]
    assert all((b.native_spec is not None) == (kernels == "cpu") for b in blocks)  # BF16 tiles
    oracles = [AutoModelForCausalLM.from_pretrained(bf16, dtype=d).eval()
               for d in (torch.float32, torch.bfloat16)]
    for prompt in _prompts():
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0, max_tokens=1, logprobs=5))
        gaps = []
        for oracle in oracles:
            with torch.no_grad():
                logits = oracle(torch.tensor([prompt])).logits[0, -1].float()
            theirs = torch.log_softmax(logits, -1)
            top = out.outputs[0].logprobs[0].top
            gaps.append(max(abs(lp - float(theirs[t])) for t, _, lp in top))
        assert min(gaps) < 0.03, (len(prompt), gaps)


def test_config_reads_gpt_oss_options(tmp_path, smol_tokenizer_dir):
    from pagewire.executor.models.model_config import LlamaConfig
    import json
    path = make_gpt_oss(str(tmp_path / "m"), smol_tokenizer_dir)
    with open(os.path.join(path, "config.json")) as f:
        cfg = LlamaConfig.from_hf(json.load(f))
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (4, 2, 64)
    assert cfg.attention_sinks and cfg.moe_bias and cfg.topk_then_softmax
    assert (cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit) == ("swiglu_oai", 1.702, 7.0)
    assert cfg.attention_bias and cfg.o_proj_bias and not cfg.qk_norm
    assert cfg.layer_windows == [WINDOW, None, WINDOW, None] and cfg.sliding_window is None
    assert cfg.rope_tables[0][1]["rope_type"] == "yarn" and cfg.rope_table_len == 512


@pytest.mark.parametrize("options, what", [
    (dict(tensor_parallel_size=4, decode_context_parallel_size=2, device="cpu"),  # any host
     "--decode-context-parallel-size > 1"),
    (dict(kv_compress_rate=0.5, enable_prefix_caching=False), "--kv-compress-rate")])
def test_what_gpt_oss_cannot_do_yet_is_refused_by_name(tmp_path, smol_tokenizer_dir, options,
                                                       what):
    path = make_gpt_oss(str(tmp_path / "m"), smol_tokenizer_dir)
    with pytest.raises(ValueError, match=f"GptOssForCausalLM with {re.escape(what)} is not"):
        LLM(path, dtype="float32", num_kv_blocks=64, **options)


def test_speculation_keeps_the_tokens(tmp_path, smol_tokenizer_dir):
    """n-gram drafts verified through sinks, windows and experts (several tokens a sequence
    in one step, over cached context) leave greedy answers as they were."""
    path = make_gpt_oss(str(tmp_path / "m"), smol_tokenizer_dir)
    prompts = [{"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8] * 3}, {"prompt_token_ids": [40] * 9}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**options) -> list[list[int]]:
        llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256, **options)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert run(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1}) == run()


def bf16_copy(tmp_path, tokenizer_dir) -> str:
    """The TIGHT model saved in bfloat16, as gpt-oss's unquantized checkpoints are."""
    from transformers import AutoModelForCausalLM
    path = make_gpt_oss(str(tmp_path / "f32"), tokenizer_dir, **TIGHT)
    bf16 = str(tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(bf16)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), bf16)
    return bf16


def test_the_released_config_reads():
    """openai/gpt-oss-20b's config.json (its MXFP4 quantization_config aside): 24 layers
    alternating from sliding, 32 experts top 4, yarn x32 from 4096, so 131072 positions
    tabled and served, not 131072 x 32."""
    from pagewire.executor.models.model_config import LlamaConfig
    from pagewire.rope_scaling import hf_context_length, hf_rope_scaling
    hf = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
          "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
          "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
          "max_position_embeddings": 131072, "model_type": "gpt_oss",
          "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
          "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
          "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                           "truncate": False},
          "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
          "tie_word_embeddings": False, "vocab_size": 201088}
    cfg = LlamaConfig.from_hf(hf)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (32, 4, 2880)
    assert cfg.layer_windows == [128, None] * 12 and cfg.head_dim == 64
    assert cfg.rope_tables[0][0] == 150000 and cfg.rope_tables[0][1]["factor"] == 32.0
    assert cfg.rope_table_len == 131072
    assert hf_context_length(hf, hf_rope_scaling(hf)) == 131072


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_every_positions_logits_within_bound(tmp_path, smol_tokenizer_dir, kernels):
    """One 70-token prompt's logits at every position, ours (a prefill through the paged
    cache) against transformers', float32: within 2e-5 (measured: see the print)."""
    from pagewire.kernels.attention import AttentionBatch, PrefillSpan
    path = make_gpt_oss(str(tmp_path / "m"), smol_tokenizer_dir, **TIGHT)
    runner = LLM(path, dtype="float32", kernels=kernels, block_size=16, num_kv_blocks=64).runner
    prompt = _prompts()[2]
    n = len(prompt)
    span = PrefillSpan(0, n, n, torch.arange(-(-n // 16)))
    batch = AttentionBatch(torch.arange(n), 0, None, None, [span])
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), torch.arange(n), runner.kv_caches, batch)
        ours = runner.model.compute_logits(hidden)
        theirs = HFOracle.from_dir(path).model(torch.tensor([prompt])).logits[0].float()
    worst = float((ours - theirs).abs().max())
    print(kernels, "max |logit difference| over", n, "positions:", worst)
    assert worst < 2e-5
