"""Shared-prefix workload: prefix caching on versus off (or prefix wait on versus off), in one
run.

    python bench/shared_prefix.py [--requests 64] [--prefix 512] [--unique 32] [--output 64]
                                  [--compare caching|prefix-wait]

Each request is a common prefix of random tokens, then its own unique tokens; all ask for
`--output` tokens (ignore_eos) and arrive together (one burst). Both engines load the default
model and run the same requests, alternating (on, off, on, off) so drift in the machine hits
both alike; each run uses a fresh prefix (no warm cache carried over). `--compare caching`
(the default) turns prefix caching off in the second engine, `--compare prefix-wait` only
prefix wait (docs/kv-cache.md). Prints output tok/s, the mean and largest time to first token
(from the burst's arrival to the step that sampled a request's first token), the hit rate and
the throughput ratio.
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


def run(llm: LLM, prompts: list[list[int]], output: int) -> tuple[float, float, list[float]]:
    """(output tok/s, hit rate, each request's time to first token)."""
    tables = llm.scheduler.tables
    queries, hits = tables.prefix_queries, tables.prefix_hits
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    start = time.perf_counter()
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts]
    first: dict[str, float] = {}
    while llm.has_unfinished():
        done = llm.step()
        now = time.perf_counter() - start
        for seq in llm.scheduler.seqs.values():      # sampled its first token in this step
            if seq.num_output_tokens and seq.request.req_id not in first:
                first[seq.request.req_id] = now
        for out in done:
            first.setdefault(out.request_id, now)
    elapsed = time.perf_counter() - start
    q, h = tables.prefix_queries - queries, tables.prefix_hits - hits
    return len(prompts) * output / elapsed, (h / q if q else 0.0), [first[i] for i in ids]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--unique", type=int, default=32)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--compare", choices=("caching", "prefix-wait"), default="caching")
    args = p.parse_args()
    opts = dict(max_model_len=2048, kv_cache_memory=2 * 2**30)
    off = {"enable_prefix_caching": False} if args.compare == "caching" else {"prefix_wait": False}
    engines = {"on": LLM(args.model, **opts), "off": LLM(args.model, **off, **opts)}
    for llm in engines.values():     # first steps warm the kernels and allocator: not timed
        llm.generate([{"prompt_token_ids": list(range(100, 164))}],
                     SamplingParams(temperature=0, max_tokens=2))
    rng = random.Random(0)
    results = {"on": [], "off": []}
    for _ in range(args.rounds):
        prompts = workload(rng, args)
        for mode, llm in engines.items():
            results[mode].append(run(llm, prompts, args.output))
    print(f"workload: {args.requests} requests, {args.prefix}-token shared prefix, "
          f"{args.unique} unique tokens each, {args.output} output tokens")
    for mode in ("on", "off"):
        tps = " ".join(f"{t:.1f}" for t, _, _ in results[mode])
        rates = " ".join(f"{r:.1%}" for _, r, _ in results[mode])
        ttft = " ".join(f"{sum(f) / len(f):.2f}/{max(f):.2f}" for _, _, f in results[mode])
        print(f"{args.compare} {mode:3}: output tok/s {tps}; TTFT mean/max s {ttft}; "
              f"hit rate {rates}")
    ratio = [on[0] / off[0] for on, off in zip(results["on"], results["off"])]
    print(f"throughput ratio on/off per round: {' '.join(f'{r:.2f}x' for r in ratio)}")


if __name__ == "__main__":
    main()
