"""The GPT family from GGUF files written as llama.cpp's converter writes them: GPT-NeoX
(`gptneox`: LayerNorms with biases, its head-by-head fused QKV, rope on a quarter of each head,
parallel residual or not) gives transformers' greedy tokens on the file's values, its linears
multiplying the file's blocks. (Hugging Face directories: test_architectures.py.)"""
from __future__ import annotations

import pytest

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
    _check_greedy(llm, ref, f"{name} {qtype}")
