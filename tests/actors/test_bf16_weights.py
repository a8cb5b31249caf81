"""A bfloat16 checkpoint's linears as BF16 tiles (executor/linear_blocks.py keep_bf16_tiles): every
step multiplies them natively, the fused decode stack included, and no float copy is kept."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagewire import LLM, SamplingParams
from pagewire.kernels import quant
from pagewire.kernels.linear import Linear
from tests.helpers import HFOracle, assert_greedy_equal, make_tiny_llama

PROMPTS = [[5, 77, 300, 12], list(range(40, 90))]


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory, smol_tokenizer_dir) -> str:
    """A tiny Llama stored in bfloat16, as most Hugging Face checkpoints are."""
    path = make_tiny_llama(str(tmp_path_factory.mktemp("bf16") / "m"), smol_tokenizer_dir,
                           vocab_size=512, seed=3)
    file = os.path.join(path, "model.safetensors")
    save_file({k: v.bfloat16() for k, v in load_file(file).items()}, file)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "torch_dtype": "bfloat16"}, f)
    return path


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def test_a_bfloat16_checkpoint_runs_on_bf16_tiles(bf16_llama, tier):
    llm = LLM(bf16_llama, dtype="bfloat16", kernels=tier, max_model_len=256, num_kv_blocks=64)
    model = llm.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1
    assert all(m.quantized.kind == quant.BF16 and m.weight is None and m.packed is None
               for m in linears)
    assert model.fused_decode is not None
    oracle = HFOracle.from_dir(bf16_llama)         # transformers on the same bf16 values
    for prompt, tokens in zip(PROMPTS, _greedy(llm)):
        assert_greedy_equal(tokens, *oracle.greedy(prompt, len(tokens)))


def test_quantized_matmul_tokens_0_keeps_the_float_path(bf16_llama):
    llm = LLM(bf16_llama, dtype="bfloat16", max_model_len=256, num_kv_blocks=64,
              quantized_matmul_tokens=0)
    model = llm.runner.model
    assert model.fused_decode is None and model.lm_head.quantized is None


def test_a_float32_engine_reads_bfloat16_weights_as_tiles_for_small_steps(bf16_llama, tier):
    """As a CPU without a bfloat16 dot product runs a bfloat16 checkpoint: float32, the
    tiles (half the bytes) for steps of up to --quantized-matmul-tokens, exact, and the
    float32 copy for larger ones."""
    llm = LLM(bf16_llama, dtype="float32", kernels=tier, max_model_len=256, num_kv_blocks=64,
              quantized_matmul_tokens=4)
    model = llm.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quantized.kind == quant.BF16 and m.quantized_max_tokens == 4 for m in linears)
    assert all(m.packed is not None or m.weight is not None for m in linears)
    assert model.fused_decode is not None and model.fused_decode.max_tokens == 4
    oracle = HFOracle.from_dir(bf16_llama)
    for prompt, tokens in zip(PROMPTS, _greedy(llm)):
        assert_greedy_equal(tokens, *oracle.greedy(prompt, len(tokens)))


def test_weights_that_are_not_bfloat16_values_keep_float32(tmp_path, smol_tokenizer_dir):
    path = make_tiny_llama(str(tmp_path / "m"), smol_tokenizer_dir, vocab_size=512, seed=4)
    llm = LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert all(m.quantized is None for m in llm.runner.model.modules() if isinstance(m, Linear))
