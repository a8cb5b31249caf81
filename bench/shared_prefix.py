"""Shared-prefix workload: prefix caching on versus off, in one run.

    python bench/shared_prefix.py [--requests 64] [--prefix 512] [--unique 32] [--output 64]

Each request is a common prefix of random tokens, then its own unique tokens; all ask for
`--output` tokens (ignore_eos). Both engines load the default model (bf16) and run the same
requests, alternating (on, off, on, off) so drift in the machine hits both alike; each run
uses a fresh prefix (no warm cache carried over). Prints the hit rate and the throughput ratio.
"""
from __future__ import annotations

import argparse
import random
import time

from pagewire import LLM, SamplingParams


def workload(rng: random.Random, args) -> list[list[int]]:
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix)]
    return [prefix + [rng.randrange(100, 40000) for _ in range(args.unique)]
            for _ in range(args.requests)]


def run(llm: LLM, prompts: list[list[int]], output: int) -> tuple[float, float]:
    tables = llm.scheduler.tables
    queries, hits = tables.prefix_queries, tables.prefix_hits
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    q, h = tables.prefix_queries - queries, tables.prefix_hits - hits
    return len(prompts) * output / elapsed, (h / q if q else 0.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--unique", type=int, default=32)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    opts = dict(max_model_len=2048, kv_cache_memory=2 * 2**30)
    engines = {"on": LLM(args.model, **opts),
               "off": LLM(args.model, enable_prefix_caching=False, **opts)}
    rng = random.Random(0)
    results = {"on": [], "off": []}
    for _ in range(args.rounds):
        prompts = workload(rng, args)
        for mode, llm in engines.items():
            results[mode].append(run(llm, prompts, args.output))
    print(f"workload: {args.requests} requests, {args.prefix}-token shared prefix, "
          f"{args.unique} unique tokens each, {args.output} output tokens")
    for mode in ("on", "off"):
        tps = [t for t, _ in results[mode]]
        rates = [r for _, r in results[mode]]
        print(f"prefix caching {mode:3}: output tok/s {' '.join(f'{t:.1f}' for t in tps)}; "
              f"hit rate {' '.join(f'{r:.1%}' for r in rates)}")
    ratio = [on[0] / off[0] for on, off in zip(results["on"], results["off"])]
    print(f"throughput ratio on/off per round: {' '.join(f'{r:.2f}x' for r in ratio)}")


if __name__ == "__main__":
    main()
