"""A quantized KV cache against the model's own dtype, on the default model: quality, then
decode speed.

    python bench/kv_quant.py [--kv-dtypes int8,fp8,fp8_e5m2] [--contexts 1024,4096]
                             [--batch 8] [--rounds 2]

Quality: the text in bench/data/declaration.txt (the Declaration of Independence, public
domain), teacher-forced in 256-token chunks (so each chunk reads the earlier ones from the
cache): perplexity, and the mean KL divergence of each position's next-token distribution from
the `auto` cache's.
Speed: `--batch` sequences of random prompts of each context length, then 64 greedy tokens
each; decode tokens per second = batch * 63 / (time with 64 tokens - time with 1), both after
the prompts are cached (prefix caching maps them), alternating dtypes.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import time

import torch

from pagewire import LLM, SamplingParams

TEXT = os.path.join(os.path.dirname(__file__), "data", "declaration.txt")


def next_token_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[n - 1, V] log-softmax of every prompt position (captured as prompt_logprobs computes
    them)."""
    model, rows = llm.runner.model, []
    original = model.compute_logits

    def capture(hidden):
        logits = original(hidden)
        rows.append(torch.log_softmax(logits.float(), -1))
        return logits
    model.compute_logits = capture
    try:
        llm.generate([{"prompt_token_ids": ids}],
                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    finally:
        model.compute_logits = original
    return torch.cat(rows)[:len(ids) - 1]          # the last row is the sampled token's


def quality(kv_dtypes: list[str]) -> None:
    kw = dict(max_num_batched_tokens=256, enable_prefix_caching=False, max_model_len=4096)
    ref_llm = LLM(**kw)
    ids = ref_llm.tokenizer.encode(open(TEXT).read())
    ref = next_token_logprobs(ref_llm, ids)
    target = torch.tensor(ids[1:])
    del ref_llm
    print(f"quality: {len(ids)} tokens of {os.path.basename(TEXT)}, chunks of 256")
    for kv in ["auto", *kv_dtypes]:
        lp = ref if kv == "auto" else next_token_logprobs(LLM(kv_cache_dtype=kv, **kw), ids)
        ppl = math.exp(-lp.gather(1, target[:, None]).mean().item())
        kl = (ref.exp() * (ref - lp)).sum(-1)
        print(f"  {kv:9s} perplexity {ppl:.3f}  KL vs auto mean {kl.mean():.2e} "
              f"max {kl.max():.2e}", flush=True)


def decode_rate(llm: LLM, prompts: list[list[int]]) -> float:
    """The prompts are computed once (cached); both timed runs then map them from the prefix
    cache, so their difference is 63 decode steps."""
    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start
    run(1)
    return len(prompts) * 63 / (run(64) - run(1))


def speed(kv_dtypes: list[str], contexts: list[int], batch: int, rounds: int) -> None:
    rng = random.Random(0)
    engines = {kv: LLM(kv_cache_dtype=kv, max_model_len=max(contexts) + 64,
                       kv_cache_memory=2 * 2**30)
               for kv in ["auto", *kv_dtypes]}
    for ctx in contexts:
        prompts = [[rng.randrange(100, 40000) for _ in range(ctx)] for _ in range(batch)]
        for r in range(rounds):
            rates = {kv: decode_rate(llm, prompts) for kv, llm in engines.items()}
            print(f"context {ctx} x {batch}, round {r}: " + ", ".join(
                f"{kv} {rate:.1f} tok/s ({rate / rates['auto']:.2f}x)"
                for kv, rate in rates.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtypes", default="int8,fp8,fp8_e5m2")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    kv_dtypes = args.kv_dtypes.split(",")
    if not args.skip_quality:
        quality(kv_dtypes)
    speed(kv_dtypes, [int(c) for c in args.contexts.split(",")], args.batch, args.rounds)


if __name__ == "__main__":
    main()
