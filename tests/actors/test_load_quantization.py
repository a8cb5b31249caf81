"""--quantization int8|int4 (actors/executor/load_quantization.py): the blocks round-trip as
GGML's dequantization reads them, and a tiny float checkpoint rounded at load gives
transformers' greedy tokens on the same rounded weights, its decode steps on the blocks."""
from __future__ import annotations

import os
import random

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.executor.load_quantization import round_weight
from pagewire.kernels import quant
from pagewire.kernels.linear import Linear
from tests.helpers import HFOracle, assert_greedy_equal, use_private_cache


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The blocks these throwaway models round are cached out of ~/.cache."""
    use_private_cache(tmp_path, monkeypatch)


@pytest.mark.parametrize("ggml, levels", [(quant.Q8_0, 255), (quant.Q4_1, 16)])
def test_blocks_hold_the_nearest_of_their_levels(ggml, levels):
    g = torch.Generator().manual_seed(ggml)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 48)[:, None]
    raw, values = round_weight(w, ggml)
    block_bytes = {quant.Q8_0: 34, quant.Q4_1: 20}[ggml]
    assert raw.dtype == torch.uint8 and raw.shape == (48, 3 * block_bytes)
    blocks = w.reshape(48, 3, 32)
    spread = blocks.abs().amax(-1) * 2 if ggml == quant.Q8_0 else \
        blocks.amax(-1) - blocks.amin(-1)
    step = (spread / (levels - 1)).repeat_interleave(32, 1)
    err = (values - w).abs()
    assert (err <= step / 2 * 1.01 + 1e-6).all()            # float16 scales: 1 % slack
    per_block = values.reshape(-1, 32)
    assert max(len(block.unique()) for block in per_block) <= min(levels, 32)
    assert err.max() > 0


def _rounded_oracle(path: str, mode: str) -> HFOracle:
    oracle = HFOracle.from_dir(path)
    with torch.no_grad():
        for name, module in oracle.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                ggml = quant.Q8_0 if mode == "int8" or name == "lm_head" else quant.Q4_1
                module.weight.copy_(round_weight(module.weight, ggml)[1])
    return oracle


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_rounded_checkpoint_matches_transformers_on_the_same_weights(tiny_llama, mode,
                                                                       kernels):
    path = tiny_llama()
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=256, kernels=kernels,
              quantization=mode)
    linears = [m for m in llm.runner.model.modules() if isinstance(m, Linear)]
    if kernels == "auto" and quant.available(llm.runner.model.ops.lib):
        # Kinds are the GGML type plus 100 or 200 where the activations are rounded.
        kinds = {m.quantized.kind % 100 for m in linears[:-1]}   # the layers', then the head
        assert kinds == {quant.Q8_0 if mode == "int8" else quant.Q4_1}
        assert llm.runner.model.lm_head.quantized.kind % 100 == quant.Q8_0
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 33)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    oracle = _rounded_oracle(path, mode)
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 12)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{mode} {len(prompt)}")


def test_a_gguf_file_is_not_quantized_again():
    with pytest.raises(ValueError, match="already quantized"):
        LLM(quantization="int8", max_model_len=256)


def test_the_encoders_reproduce_the_default_ggufs_own_blocks():
    """Re-rounding a GGUF's dequantized Q4_1 and Q8_0 tensors gives back the file's bytes: the
    block layouts (scale, minimum, nibble order) are GGML's, and each block's scale (and
    minimum) comes back from its own values."""
    from pagewire.executor.gguf_weights import read_blocks
    from pagewire.executor.gguf_weights import dequantize_rows
    from pagewire.executor.load_quantization import _BLOCKS
    from pagewire.gguf_header import read_gguf_header
    from pagewire.model_info import resolve_model
    info = resolve_model(None)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.5.mlp.down_proj.weight",
             "model.embed_tokens.weight", "lm_head.weight"]
    blocks = read_blocks(info.path, read_gguf_header(info.path), names,
                         {quant.Q4_1, quant.Q8_0}, info.num_heads, info.num_kv_heads)
    assert {t for t, _ in blocks.values()} == {quant.Q4_1, quant.Q8_0}
    for name, (ggml, raw) in blocks.items():
        values = dequantize_rows(ggml, raw)
        assert torch.equal(_BLOCKS[ggml](values), raw), name


def test_the_rounded_blocks_are_cached_by_digest(tiny_llama, monkeypatch):
    """A second start reads the blocks the first rounded (nothing is rounded again) and
    decodes the same tokens; a change of dtype or mode is another cache file."""
    from pagewire.executor import load_quantization, weight_cache
    from pagewire.model_info import resolve_model
    path = tiny_llama()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 33, 2, 71]}]

    def run():
        llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128,
                  quantization="int4")
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    first = run()
    digest = resolve_model(path).digest
    assert os.path.isfile(weight_cache.cache_path(digest, torch.float32, "int4"))
    assert not os.path.exists(weight_cache.cache_path(digest, torch.float32, "int8"))

    def refuse(*args):
        raise AssertionError("rounded again")
    monkeypatch.setattr(load_quantization, "round_weight", refuse)
    assert run() == first
