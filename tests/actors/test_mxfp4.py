"""MXFP4 weights (gpt-oss's experts' format) in a whole model: a tiny Llama whose linears a
GGUF file stores as MXFP4 (gguf-py quantizes them) runs on every native CPU tier from the
file's blocks (as Q8_0 blocks of the same values) and on the torch reference (dequantized),
greedy-equal to transformers on the same file (its own dequantization of it)."""
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
from tests.helpers import HFOracle, assert_greedy_equal, use_private_cache

gguf = pytest.importorskip("gguf")
VOCAB = 512


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    use_private_cache(tmp_path, monkeypatch)


def _small_tokenizer(meta: dict) -> dict:
    """The first VOCAB tokens and the merges among them (a valid BPE transformers parses
    fast; the model is fed token ids)."""
    meta = dict(meta)
    tokens = meta["tokenizer.ggml.tokens"][:VOCAB]
    kept = set(tokens)
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:VOCAB]
    meta["tokenizer.ggml.merges"] = [
        m for m in meta["tokenizer.ggml.merges"]
        if all(part in kept for part in m.split(" ", 1)) and m.replace(" ", "", 1) in kept]
    return meta


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
                      _small_tokenizer(gguf_tokenizer_meta), "MXFP4")
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=256, kernels=kernels,
              quantized_matmul_tokens=-1)
    kinds = {s.kind % 100 for m in llm.runner.model.modules() if isinstance(m, Linear)
             and m.quantized is not None for s in m.quantized.segments}
    # every linear's blocks as Q8_0 tiles (however the tier's default rounds activations)
    assert kinds == (set() if kernels == "torch" else {quant.Q8_0})
    oracle = HFOracle(AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="mx.gguf",
                                                           dtype=torch.float32))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 33)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{kernels} {len(prompt)}")
