"""Mixture-of-experts models from GGUF files written as llama.cpp's converter writes them
(experts stacked [experts, rows, cols] per projection): every expert's Linear multiplies its
slice of the stack as stored, and greedy tokens equal transformers' on the file's values; on
each native CPU tier and in bfloat16 too. The safetensors side is in test_architectures.py."""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.executor.gguf_weights import read_gguf_weights
from pagewire.executor.loader import read_safetensors
from pagewire.executor.models.moe import SparseMoE
from pagewire.gguf_header import read_gguf_header
from pagewire.kernels.linear import Linear
from pagewire.model_info import hf_text_config, resolve_model
from pagewire.testing.gguf_writer import write_gguf
from tests.actors.test_architectures import VOCAB, make_model
from tests.helpers import (HFOracle, answers_as_planes_and_codes, assert_greedy_equal,
                           use_private_cache)

# (test_architectures config, GGUF arch, type, overrides): llama.cpp has no sliding window
# for Mixtral nor dense layers among Qwen2-MoE's sparse ones; K-quants need 256-wide rows.
CASES = {
    "mixtral-Q8_0": ("mixtral-moe", "llama", "Q8_0", dict(sliding_window=None)),
    "qwen2-moe-Q4_0": ("qwen2-moe-shared", "qwen2moe", "Q4_0", dict(mlp_only_layers=[])),
    "qwen3-moe-Q4_K_M": ("qwen3-moe", "qwen3moe", "Q4_K_M", dict(
        hidden_size=256, head_dim=64, moe_intermediate_size=256, num_hidden_layers=2)),
    "olmoe-Q8_0": ("olmoe", "olmoe", "Q8_0", {}),
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    use_private_cache(tmp_path, monkeypatch)


def _gguf_and_reference(tmp_path, tokenizer_dir, meta, case, fuse=None) -> tuple[str, str]:
    """(the GGUF file, a Hugging Face directory of the values its blocks hold) of CASES[case]
    or of a (test_architectures config, GGUF arch, type, overrides) tuple. `fuse`: rewrites
    the Hugging Face tensors before they are written (older files' fused layouts)."""
    import json
    from safetensors.torch import save_file
    name, arch, qtype, overrides = CASES[case] if isinstance(case, str) else case
    hf_dir = make_model(str(tmp_path / "hf"), tokenizer_dir, name, **overrides)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = hf_text_config(json.load(f))
    state = (fuse or (lambda s: s))(read_safetensors(hf_dir))
    path = write_gguf(str(tmp_path / "m.gguf"), arch, state, cfg, meta, qtype)
    header = read_gguf_header(path)
    info = resolve_model(path)
    values = read_gguf_weights(path, header, cfg["num_attention_heads"], info.num_kv_heads)
    ref = str(tmp_path / "ref")
    shutil.copytree(hf_dir, ref)
    save_file({k: v.contiguous() for k, v in values.items()},
              os.path.join(ref, "model.safetensors"))
    return path, ref


def _check_greedy(llm, ref: str, label: str) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 37, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = HFOracle.from_dir(ref)
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 10)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits,
                            f"{label}, prompt {len(prompt)}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_experts_as_stored_match_transformers(tmp_path, smol_tokenizer_dir,
                                                   gguf_tokenizer_meta, case):
    """Every block runs natively (csrc/moe.cpp) and decode steps through the fused stack."""
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, case)
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    model = llm.runner.model
    blocks = [sparse for sparse in model.modules() if isinstance(sparse, SparseMoE)]
    assert blocks and len(blocks[0].experts) == model.cfg.num_experts
    for sparse in blocks:            # every expert's weights: the file's blocks, no float copy
        assert sparse.native_spec is not None
        for expert in sparse.experts.values():
            for linear in (expert.gate_up, expert.down):
                assert linear.quantized is not None and linear.weight is None
    assert model.fused_decode is not None
    _check_greedy(llm, ref, case)
    # A one-token prompt and three decode steps: one token a step, so each sparse layer reads
    # exactly its top k (pagewire:moe_experts_read counts these)
    sched = llm.scheduler
    before = sched.num_experts_read, sched.num_moe_steps
    llm.generate([{"prompt_token_ids": [5]}], SamplingParams(temperature=0, max_tokens=4,
                                                             ignore_eos=True))
    reads = sched.num_experts_read - before[0], sched.num_moe_steps - before[1]
    assert reads == (4 * model.cfg.experts_per_token * len(blocks), 4)


@pytest.mark.parametrize("case, dtype", [("olmoe-Q8_0", "float32"), ("olmoe-Q8_0", "bfloat16"),
                                         ("qwen3-moe-Q4_K_M", "bfloat16")])
def test_fused_decode_of_experts_equals_the_per_op_path(tmp_path, smol_tokenizer_dir,
                                                        gguf_tokenizer_meta, case, dtype):
    """OLMoE (q/k norms over all heads) and Qwen3-MoE (per head), their experts: the fused
    stack's hidden states and KV writes are the per-op path's bit for bit."""
    from tests.actors.test_fused_decode import assert_fused_equals_per_op
    path, _ = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, case)
    assert_fused_equals_per_op(LLM(path, dtype=dtype, num_kv_blocks=64, max_model_len=512).runner,
                               VOCAB)


def test_int8_all_experts_take_q6_k_bit_planes_as_they_take_its_codes(
        tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, monkeypatch):
    """int8-all on avx512_bf16: Qwen3-MoE Q4_K_M's Q6_K experts multiply as bit planes
    (Q6_KP) through csrc/moe.cpp and the fused stack, answering what the same engine answers
    with Q6_KS's codes (the same integer sums)."""
    from pagewire.kernels import quant, tiers
    if tiers.best() != "avx512_bf16":
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    path, _ = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                  "qwen3-moe-Q4_K_M")
    prompts = [{"prompt_token_ids": [5, 77, 300, 12, 9, 41, 8, 100, 3, 250]},
               {"prompt_token_ids": [7, 42, 19, 2, 61]}]
    answers = answers_as_planes_and_codes(
        lambda: LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24,
                    num_kv_blocks=64, quantized_activations="int8-all"),
        lambda model: [linear for sparse in model.modules() if isinstance(sparse, SparseMoE)
                       for expert in sparse.experts.values()
                       for linear in (expert.gate_up, expert.down)], prompts, monkeypatch)
    (planes, planes_out), (codes, codes_out) = answers["planes"], answers["codes"]
    assert quant.Q6_KP + 100 in planes and quant.Q6_KS + 100 in codes
    assert planes_out == codes_out


def test_moe_on_each_tier(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, tier):
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                    "qwen2-moe-Q4_0")
    llm = LLM(path, dtype="float32", kernels=tier, block_size=16, max_num_batched_tokens=24,
              num_kv_blocks=64)
    _check_greedy(llm, ref, tier)


def test_moe_in_bfloat16_stays_close_to_float32(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta):
    """bfloat16 activations (each expert's output rounded, their weighted sum in float32):
    the first token's top log-probabilities within bfloat16's reach of transformers' float32
    ones on the same values (greedy runs of this tiny model meet near-ties of 0.005)."""
    path, ref = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta,
                                    "qwen2-moe-Q4_0")
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64)
    oracle = HFOracle.from_dir(ref)
    for prompt in ([5, 9, 300, 41], list(range(3, 60))):
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0, max_tokens=1, logprobs=5))
        with torch.no_grad():
            theirs = torch.log_softmax(oracle.model(torch.tensor([prompt])).logits[0, -1], -1)
        for token_id, _, logprob in out.outputs[0].logprobs[0].top:
            assert abs(logprob - float(theirs[token_id])) < 0.05, (prompt, token_id)


def test_moe_linears_are_counted_per_expert(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta):
    """The start-up log's holdings count every expert's Linears; its account of the experts
    says how many a token reads."""
    from pagewire.executor.linear_blocks import holdings
    from pagewire.executor.models.moe import describe_experts
    path, _ = _gguf_and_reference(tmp_path, smol_tokenizer_dir, gguf_tokenizer_meta, "olmoe-Q8_0")
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    linears = sum(isinstance(m, Linear) for m in llm.runner.model.modules())
    # 3 layers x (qkv, o, 6 experts x 2) + the LM head; the routers are plain float ones
    assert linears == 3 * (2 + 12) + 1
    assert f"over {linears} Linears" in holdings(llm.runner.model)
    said = describe_experts(llm.runner.model)
    assert said.startswith("mixture of experts: 6 experts, 2 a token, in 3 of 3 layers")
    assert said.endswith("3 blocks native")


def test_speculation_and_kv_compress_keep_the_tokens(tmp_path, smol_tokenizer_dir):
    """n-gram drafts verified through the experts (several tokens a sequence in one step) and
    KV-Compress (attention only) leave greedy answers as they were (KV-Compress at rate 1:
    nothing evicted)."""
    path = make_model(str(tmp_path / "hf"), smol_tokenizer_dir, "qwen2-moe-shared")
    prompts = [{"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8] * 3}, {"prompt_token_ids": [40] * 9}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**options) -> list[list[int]]:
        llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256, **options)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    plain = run()
    assert run(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1}) == plain
    assert run(kv_compress_rate=1.0, enable_prefix_caching=False) == plain
