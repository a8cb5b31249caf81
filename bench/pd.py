"""Disaggregated prefill/decode on two engines versus one engine with both cores, under a
bursty mix of long prompts and steady decodes; in one run.

    python bench/pd.py [--streams 4] [--stream-tokens 96] [--burst 3] [--long 384]
        [--bursts 3] [--model PATH]

Setup A: one `pagewire serve` with 2 threads. Setup B: a prefill engine and a decode engine
(1 thread each, kv_producer / kv_consumer) behind `pagewire router`. On each (A, B, A, B):
`--streams` steady streams (16-token prompts, `--stream-tokens` outputs each, streamed) run
while `--bursts` bursts of `--burst` long prompts (`--long` tokens, 8 outputs) arrive, one
burst every 4 s. Prints, per setup, the steady streams' inter-token latency p50/p99 and every
request's time to first token p50/p99 (streamed requests: the first content event).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import tempfile
import threading
import time
import urllib.request

from pagewire.testing.server import Router, Server, free_port


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(time to first token, inter-token gaps) of one streamed completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    start, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - start, gaps


def run(url: str, rng: random.Random, args) -> tuple[list[float], list[float]]:
    ttfts, gaps, lock = [], [], threading.Lock()

    def one(prompt, n, steady):
        ttft, g = stream(url, prompt, n)
        with lock:
            ttfts.append(ttft)
            if steady:
                gaps.extend(g)

    def tokens(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    with concurrent.futures.ThreadPoolExecutor(args.streams + args.burst * args.bursts) as pool:
        jobs = [pool.submit(one, tokens(16), args.stream_tokens, True)
                for _ in range(args.streams)]
        for _ in range(args.bursts):
            time.sleep(4)
            jobs += [pool.submit(one, tokens(args.long), 8, False) for _ in range(args.burst)]
        for j in jobs:
            j.result()
    return ttfts, gaps


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--burst", type=int, default=3)
    p.add_argument("--long", type=int, default=384)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    run_dir = tempfile.mkdtemp(dir="/tmp")
    common = ([args.model] if args.model else []) + [
        "--served-model-name", "m", "--max-model-len", "2048"]
    kv_port = free_port()
    one = Server(common + ["--threads", "2"], run_dir)
    prefill = Server(common + ["--threads", "1", "--kv-transfer-config", json.dumps(
        {"kv_role": "kv_producer", "kv_port": kv_port})], run_dir)
    decode = Server(common + ["--threads", "1", "--kv-transfer-config",
                              json.dumps({"kv_role": "kv_consumer"})], run_dir)
    router = Router(prefill.url, decode.url)
    rng = random.Random(0)
    results = {"one engine, 2 threads": ([], []), "P/D, 1 + 1 threads": ([], [])}
    try:
        for name, url in [("one engine, 2 threads", one.url),
                          ("P/D, 1 + 1 threads", router.url)] * 2:
            ttfts, gaps = run(url, rng, args)
            results[name][0].extend(ttfts)
            results[name][1].extend(gaps)
    finally:
        router.stop()
        for s in (one, prefill, decode):
            s.stop()
    print(f"workload: {args.streams} streams x {args.stream_tokens} tokens; {args.bursts} "
          f"bursts of {args.burst} x {args.long}-token prompts, 4 s apart; two rounds each")
    for name, (ttfts, gaps) in results.items():
        print(f"{name:24} ITL p50 {pct(gaps, 50) * 1000:7.1f} ms  p99 {pct(gaps, 99) * 1000:7.1f}"
              f" ms | TTFT p50 {pct(ttfts, 50):6.2f} s  p99 {pct(ttfts, 99):6.2f} s")


if __name__ == "__main__":
    main()
