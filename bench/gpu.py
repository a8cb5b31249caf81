"""CUDA figures: single stream and offline throughput, CUDA graphs on and off, in one run.

    python bench/gpu.py [--model PATH] [--requests 64] [--input-len 128] [--output-len 128]

The default model where its package is installed; else (a GPU machine without it) random
weights of its shape in bfloat16, with the tokenizer saved at PAGEWIRE_TEST_TOKENIZER. Every
request is `--input-len` random tokens then `--output-len` greedy ones (EOS ignored); output
tok/s over the whole run, prefill included.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time

import torch

from pagewire import LLM, SamplingParams


def smollm2_shape(tokenizer_dir: str) -> str:
    """Random bfloat16 weights in SmolLM2-135M's shape, saved with the borrowed tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tempfile.mkdtemp(prefix="smollm2-shape-")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=2048, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    model = args.model
    if model is None and os.environ.get("PAGEWIRE_TEST_TOKENIZER"):
        model = smollm2_shape(os.environ["PAGEWIRE_TEST_TOKENIZER"])
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print(f"{torch.cuda.get_device_name()}: {args.input_len} in, {args.output_len} out")
    for eager in (False, True):
        llm = LLM(model, dtype="bfloat16", device="cuda", enforce_eager=eager,
                  max_model_len=args.input_len + args.output_len + 16)
        llm.generate(prompts[:2], params)                     # Triton compiles, graphs warm
        for n in (1, args.requests):
            start = time.perf_counter()
            outs = llm.generate(prompts[:n], params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"  enforce_eager={eager} batch {n}: {tokens / seconds:.1f} output tok/s "
                  f"({seconds:.2f} s)", flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
