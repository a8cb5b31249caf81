"""KV-Compress (--kv-compress-rate) on the default model: quality, memory, and the concurrency
the same KV memory admits.

    python bench/kv_compress.py [--rates 1.0,0.5,0.25] [--context 1024] [--forced 512]
                                [--requests 16] [--skip-quality] [--skip-concurrency]

Quality: the first `--context` tokens of bench/data/declaration.txt (public domain) as the
prompt (compressed once it is computed), then the next `--forced` tokens teacher-forced one
decode step each (every step's logits are recorded, then replaced by the text's next token):
perplexity of those tokens, and the mean KL divergence of each step's next-token distribution
from the engine's without compression. Blocks held at the end, against the same.
Decode: one random `--context`-token prompt, then 128 greedy tokens: tokens a second over the
127 steps after the first (time with 128 - time with 1), alternating rates.
Concurrency: `--requests` random prompts of `--context` tokens, 128 greedy tokens each, in a
KV pool of 4 uncompressed sequences: the most sequences running at once, and the time.
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
BLOCK = 16


def forced_logprobs(llm: LLM, prompt: list[int], forced: list[int]) -> tuple[torch.Tensor, int]:
    """[len(forced), V]: the log-softmax at each forced position (the first from the prompt's
    last token), each step made to take the text's token; and the blocks the sequence held."""
    model, rows, held = llm.runner.model, [], []
    original = model.compute_logits

    def force(hidden):
        logits = original(hidden)
        rows.append(torch.log_softmax(logits.float(), -1)[0])
        held.append(sum(len(r.block_ids) for r in llm.scheduler.running))
        out = torch.full_like(logits, float("-inf"))
        out[0, forced[len(rows) - 1]] = 0.0
        return out
    model.compute_logits = force
    try:
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0, max_tokens=len(forced), ignore_eos=True))
    finally:
        model.compute_logits = original
    return torch.stack(rows), held[-1]


def quality(rates: list[float], context: int, num_forced: int) -> None:
    kw = dict(enable_prefix_caching=False, max_model_len=4096, kv_compress_window=64)
    ids = LLM(max_model_len=4096).tokenizer.encode(open(TEXT).read())
    prompt, forced = ids[:context], ids[context:context + num_forced]
    target = torch.tensor(forced)
    ref, ref_blocks = forced_logprobs(LLM(**kw), prompt, forced)
    print(f"quality: {context}-token prompt, {len(forced)} tokens forced "
          f"({os.path.basename(TEXT)}), window 64")
    for rate in [None, *rates]:
        if rate is None:
            lp, blocks = ref, ref_blocks
        else:
            lp, blocks = forced_logprobs(LLM(kv_compress_rate=rate, **kw), prompt, forced)
        ppl = math.exp(-lp.gather(1, target[:, None]).mean().item())
        kl = (ref.exp() * (ref - lp)).sum(-1)
        print(f"  rate {str(rate or 'off'):5s} perplexity {ppl:.3f}  KL vs off mean "
              f"{kl.mean():.2e} max {kl.max():.2e}  blocks held at the end {blocks} "
              f"({blocks / ref_blocks:.2f}x)", flush=True)


def decode_speed(rates: list[float], context: int, rounds: int = 2) -> None:
    rng = random.Random(1)
    prompt = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(context)]}]
    engines = {rate: LLM(enable_prefix_caching=False, kv_compress_rate=rate,
                         max_model_len=context + 256, kv_cache_memory=256 * 2**20)
               for rate in [None, *rates]}

    def run(llm, n):
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start
    print(f"decode: one {context}-token prompt, 127 steps timed")
    for r in range(rounds):
        rates_seen = {rate: 127 / (run(llm, 128) - run(llm, 1)) for rate, llm in engines.items()}
        off = rates_seen[None]
        print(f"  round {r}: " + ", ".join(f"{str(rate or 'off')} {tps:.1f} tok/s "
                                           f"({tps / off:.2f}x)"
                                           for rate, tps in rates_seen.items()), flush=True)


def concurrency(rates: list[float], context: int, requests: int) -> None:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(context)]}
               for _ in range(requests)]
    blocks = 4 * -(-(context + 128) // BLOCK)
    print(f"concurrency: {requests} x {context}-token prompts, 128 tokens each, "
          f"{blocks} blocks (4 sequences uncompressed)")
    for rate in [None, *rates]:
        llm = LLM(enable_prefix_caching=False, num_kv_blocks=blocks, kv_compress_rate=rate,
                  max_model_len=context + 256)
        most, original = [0], llm.scheduler.schedule

        def schedule():
            plan = original()
            most[0] = max(most[0], len(llm.scheduler.running))
            return plan
        llm.scheduler.schedule = schedule
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        took = time.perf_counter() - start
        print(f"  rate {str(rate or 'off'):5s} most running {most[0]:3d}  {took:6.1f} s  "
              f"{requests * 128 / took:6.1f} output tok/s  preemptions "
              f"{llm.scheduler.num_preemptions}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="1.0,0.5,0.25")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--forced", type=int, default=512)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-concurrency", action="store_true")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if not args.skip_quality:
        quality(rates, args.context, args.forced)
    decode_speed(rates, args.context)
    if not args.skip_concurrency:
        concurrency(rates, args.context, args.requests)


if __name__ == "__main__":
    main()
