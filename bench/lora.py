"""LoRA adapters against the base model alone, side by side in one engine (alternating).

    python bench/lora.py [--rank 16] [--rounds 2] [--adapter-dtype float32|bfloat16|float16]
    python bench/lora.py --model-1b /tmp/llama-1b --single-only   # a larger base model
    python bench/lora.py --targets q_proj,v_proj                   # PEFT's default for Llama

--model-1b DIR writes (once) a random-weight bfloat16 Llama of ~1.1B parameters there (hidden
2048, 16 layers, intermediate 8192, 32 / 8 heads, the default model's tokenizer) and runs on
it instead of the default model: the adapter's share of a step's bytes is what sets the
single stream's ratio, and it is ~10x smaller there. --single-only skips the 64-request run.

On the default model, with random rank-r adapters on all seven projections of every layer
(or the --targets named) stored as --adapter-dtype (written to a temporary directory),
greedy, ignore_eos:
- single: one stream, 128 random prompt tokens then 128 output tokens, base vs one adapter,
  --pairs pairs a round in alternating order (base first, then adapter first), so the host's
  drift over a round weighs on both; the round's ratio is the median pair's;
- mixed: 64 requests of 128 / 128 at once, all base vs four adapters mixed uniformly
  (--max-loras 4).
Prints output tokens per second and the ratio adapter / base.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch
from safetensors.torch import save_file

from pagewire import LLM, LoRARequest, SamplingParams
from pagewire.lora_files import projection_shapes
from pagewire.model_info import resolve_model


def make_adapter(path: str, rank: int, seed: int, dtype: torch.dtype,
                 model: str | None = None, targets: tuple[str, ...] | None = None) -> str:
    info = resolve_model(model)
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}, f)
    g, weights = torch.Generator().manual_seed(seed), {}
    for layer in range(info.num_layers):
        for proj, (out, inp) in projection_shapes(info).items():
            if targets is not None and proj not in targets:
                continue
            kind = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{kind}.{proj}"
            weights[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * 0.02).to(dtype)
            weights[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.02).to(dtype)
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    return path


def random_1b(path: str) -> str:
    """A random-weight ~1.1B Llama in bfloat16 at `path` (written once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagewire.hf_tokenizer import load_tokenizer
    if not os.path.exists(os.path.join(path, "config.json")):
        config = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


def run(llm: LLM, prompts: list[list[int]], loras: list) -> float:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--adapter-dtype", default="float32",
                    choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model-1b", metavar="DIR")
    ap.add_argument("--single-only", action="store_true")
    ap.add_argument("--targets", help="projections adapted, comma-separated (default: all seven)")
    args = ap.parse_args()
    dtype = getattr(torch, args.adapter_dtype)
    model = random_1b(args.model_1b) if args.model_1b else None
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        targets = tuple(args.targets.split(",")) if args.targets else None
        adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(f"{tmp}/a{i}", args.rank, i,
                                                                dtype, model, targets))
                    for i in range(4)]
        llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=args.rank,
                  enable_prefix_caching=False)
        run(llm, prompts[:2], [None, adapters[0]])                       # warm up
        for r in range(args.rounds):
            pairs = []
            for i in range(args.pairs):
                order = [None, adapters[0]] if i % 2 == 0 else [adapters[0], None]
                rate = {id(a): run(llm, prompts[:1], [a]) for a in order}
                pairs.append((rate[id(None)], rate[id(adapters[0])]))
            base, lora = sorted(pairs, key=lambda p: p[1] / p[0])[len(pairs) // 2]
            print(f"round {r} single (median of {len(pairs)} pairs): base {base:.1f} tok/s, "
                  f"adapter {lora:.1f} tok/s, {lora / base:.2f}x; pairs "
                  f"{[round(b / a, 2) for a, b in pairs]}", flush=True)
            if args.single_only:
                continue
            base = run(llm, prompts, [None] * 64)
            mixed = run(llm, prompts, [adapters[i % 4] for i in range(64)])
            print(f"round {r} mixed: base {base:.1f} tok/s, 4 adapters {mixed:.1f} tok/s, "
                  f"{mixed / base:.2f}x", flush=True)


if __name__ == "__main__":
    main()
