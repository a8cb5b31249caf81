"""The host's time a decode step, by part, on any machine: what a GPU would wait for.

    python bench/host_time.py [--batch 64] [--output-len 64] [--rounds 5] [--async-scheduling]

A one-layer model with a 512-token vocabulary (random weights, the default tokenizer) on the
CPU, so that the forward is a small part of a step: `--batch` prompts of 16 random tokens, each
decoding `--output-len` greedy tokens through the offline LLM. Prints, for the fastest round,
the wall time a step and each part's time a step (perf_counter sums around the methods): the
executor's launch (its host work, and the forward inside it, which a GPU runs asynchronously),
its layout and table work, the sampler's draw, finish, and the scheduler's and detokenizer's
parts. On a GPU the executor's host parts must fit under the forward (#49: < 0.5 ms at batch 64).
"""
from __future__ import annotations

import argparse
import collections
import random
import tempfile
import time

import torch

from pagewire import LLM, SamplingParams
from pagewire.testing.real_shapes_hf import save_default_tokenizer


def tiny_model(path: str) -> str:
    """A one-layer Llama with a 512-token vocabulary (random float32 weights) and the
    default tokenizer (PAGEWIRE_TEST_TOKENIZER's where the default model is absent)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    save_default_tokenizer(path)
    return path


def timed(totals: collections.Counter, obj, name: str, key: str) -> None:
    """Replace obj.name by a wrapper adding its wall time to totals[key]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--async-scheduling", action="store_true")
    args = ap.parse_args()
    model = tiny_model(tempfile.mkdtemp(prefix="host-time-"))
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=512, threads=1,
              max_num_seqs=max(args.batch, 8), async_scheduling=args.async_scheduling)
    totals: collections.Counter = collections.Counter()
    runner = llm.runner
    parts = [(runner, "launch", "executor launch"), (runner, "_forward", "  forward"),
             (runner, "_layout", "  layout"), (runner.table, "apply", "  table apply"),
             (runner.sampler, "draw", "  draw"), (runner, "finish", "executor finish"),
             (llm.engine.core, "plan", "scheduler plan"),
             (llm.engine.core, "apply", "scheduler apply"),
             (llm.detokenizer, "on_deltas", "detokenizer")]
    for obj, name, key in parts:
        timed(totals, obj, name, key)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(16)]}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params)
    best = None
    for _ in range(args.rounds):
        totals.clear()
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, dict(totals))
    seconds, sums = best
    steps = args.output_len
    print(f"batch {args.batch}: {seconds / steps * 1e3:.2f} ms a step")
    for _, _, key in parts:
        print(f"  {key:<18} {sums.get(key, 0.0) / steps * 1e3:.3f} ms a step")


if __name__ == "__main__":
    main()
