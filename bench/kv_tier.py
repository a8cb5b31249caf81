"""Disk KV tier: time to first token of a request sharing a long prefix after the pool evicted
it, loaded from the tier versus recomputed, and from a restarted engine; in one run.

    python bench/kv_tier.py [--prefix 2048] [--rounds 3] [--dir /tmp/pagewire-kv-bench]

Two engines on the default model with the same small pool (`--pool-blocks`), one with
`--kv-offload-dir`. Each round, with a fresh random prefix, each engine: computes prefix +
suffix A (the tier stores it), runs an unrelated prompt that evicts the pool, then is timed on
prefix + suffix B (one output token: TTFT; the tier engine loads the prefix, the other
recomputes it), then on prefix + suffix C (the pool's own prefix hit, for reference). Then a
third engine starts on the tier's directory and is timed on each round's prefix + suffix D.
Writes are waited for before each timed request (they otherwise overlap the next steps).
"""
from __future__ import annotations

import argparse
import random
import shutil
import time

from pagewire import LLM, SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def ttft(llm: LLM, prompt: list[int]) -> float:
    if llm.runner.tier is not None:
        llm.runner.tier.flush()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE)
    return time.perf_counter() - start


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool-blocks", type=int, default=168)
    p.add_argument("--dir", default="/tmp/pagewire-kv-bench")
    p.add_argument("--model", default=None)
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    opts = dict(max_model_len=args.pool_blocks * 16, num_kv_blocks=args.pool_blocks)
    engines = {"tier": LLM(args.model, kv_offload_dir=args.dir, **opts),
               "recompute": LLM(args.model, **opts)}
    rng = random.Random(0)
    times: dict[str, list[float]] = {"tier": [], "recompute": [], "pool": [], "restart": []}
    prefixes = []
    for _ in range(args.rounds):
        prefix = tokens(rng, args.prefix)
        prefixes.append(prefix)
        evictor = tokens(rng, args.pool_blocks * 16 - 16)
        suffixes = [tokens(rng, args.suffix) for _ in range(3)]
        for name, llm in engines.items():
            llm.generate([{"prompt_token_ids": prefix + suffixes[0]}], ONE)
            llm.generate([{"prompt_token_ids": evictor}], ONE)
            times[name].append(ttft(llm, prefix + suffixes[1]))
            if name == "tier":
                times["pool"].append(ttft(llm, prefix + suffixes[2]))
    tier = engines["tier"].scheduler.tables.tier
    loaded, failures = tier.hits, tier.failures
    engines["tier"].runner.tier.flush()
    del engines
    start = time.perf_counter()
    restarted = LLM(args.model, kv_offload_dir=args.dir, **opts)
    startup = time.perf_counter() - start
    for prefix in prefixes:
        times["restart"].append(ttft(restarted, prefix + tokens(rng, args.suffix)))
    report(args, times, loaded, failures, restarted, startup)


def report(args, times, loaded, failures, restarted, startup) -> None:
    block = restarted.config.cache.kv_block_bytes
    print(f"workload: {args.prefix}-token prefix + {args.suffix} tokens, 1 output token; "
          f"pool {args.pool_blocks} blocks; a block is {block / 2**20:.2f} MiB "
          f"(dtype {restarted.config.model.dtype})")
    for name, label in (("recompute", "evicted, recomputed"), ("tier", "evicted, from tier"),
                        ("restart", "restarted, from tier"), ("pool", "in the pool")):
        print(f"  TTFT {label:22}: " + " ".join(f"{t * 1000:7.1f}" for t in times[name]) + " ms")
    ratios = [r / t for r, t in zip(times["recompute"], times["tier"])]
    print("recompute / tier per round: " + " ".join(f"{r:.2f}x" for r in ratios))
    ratios = [r / t for r, t in zip(times["recompute"], times["restart"])]
    print("recompute / restarted tier per round: " + " ".join(f"{r:.2f}x" for r in ratios))
    tier = restarted.scheduler.tables.tier
    print(f"tier blocks loaded {loaded} (failures {failures}); after restart {tier.hits} "
          f"loaded, {len(tier)} held; restarted engine built in {startup:.1f} s")


if __name__ == "__main__":
    main()
