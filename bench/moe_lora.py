"""Decode with an adapter of every expert of a mixture, against the base model, in one
engine: the native block (csrc/moe.cpp, which adds the experts' adapter deltas) and torch's
grouping (kernels/moe.py) on the same tiles.

    python bench/moe_lora.py [--model FILE] [--rank 8] [--activations int8-all]

FILE: a mixture's GGUF (default: bench/real_shapes.py's OLMoE-1B-7B-shaped Q4_K_M). The
adapter (random, bfloat16, rank --rank on every expert's gate, up and down in every layer,
PEFT's per-expert names) is written once beside the file. One stream, 8 prompt tokens then
64, greedy; prints decode tokens a second of each.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

DEFAULT = os.path.expanduser("~/.cache/pagewire/bench-models/olmoe-1b-7b-Q4_K_M.gguf")


def write_adapter(path: str, info, rank: int) -> str:
    from safetensors.torch import save_file
    if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    g, weights = torch.Generator().manual_seed(0), {}
    h, i = info.hidden_size, info.expert_intermediate_size
    for layer in range(info.num_layers):
        for e in range(info.num_experts):
            for name, (out, inp) in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                     ("down_proj", (h, i))):
                module = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{name}"
                weights[module + ".lora_A.weight"] = \
                    (torch.randn(rank, inp, generator=g) * 0.01).bfloat16()
                weights[module + ".lora_B.weight"] = \
                    (torch.randn(out, rank, generator=g) * 0.01).bfloat16()
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}, f)
    return path


def main() -> None:
    from pagewire import LLM, LoRARequest, SamplingParams
    from pagewire.executor.models.moe import SparseMoE
    from pagewire.model_info import resolve_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--activations", default="int8-all")
    args = ap.parse_args()
    adapter = write_adapter(f"{args.model}.experts-r{args.rank}", resolve_model(args.model),
                            args.rank)
    llm = LLM(args.model, quantized_activations=args.activations, max_model_len=1024,
              enable_lora=True, max_loras=1, max_lora_rank=args.rank,
              enable_prefix_caching=False)
    request = LoRARequest("experts", 1, adapter)

    def rate(lora) -> float:
        llm.generate([{"prompt_token_ids": list(range(100, 108))}],
                     SamplingParams(max_tokens=4, ignore_eos=True), lora_request=lora)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(200, 208))}],
                     SamplingParams(max_tokens=64, ignore_eos=True, temperature=0),
                     lora_request=lora)
        return 64 / (time.perf_counter() - start)

    print(f"base, native block: {rate(None):.1f} tok/s")
    print(f"expert adapter, native block: {rate(request):.1f} tok/s")
    model = llm.runner.model
    for block in model.modules():
        if isinstance(block, SparseMoE):
            block.native_spec = None
    model._fused = None
    print(f"expert adapter, torch's grouping: {rate(request):.1f} tok/s")
    print(f"base, torch's grouping: {rate(None):.1f} tok/s")


if __name__ == "__main__":
    main()
