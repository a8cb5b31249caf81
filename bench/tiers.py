"""Every native CPU tier this machine runs, side by side on the default model: single stream,
offline throughput, prefill and memory, one tier per child process.

    python bench/tiers.py [--tiers avx2,avx512,avx512_bf16] [--dtypes auto,bfloat16] [--runs 1]
                          [--matmul-tokens auto,16]

Per (tier, dtype): single stream = 128 random prompt tokens then 128 greedy (output tok/s over
the whole request, as `pagewire bench latency` counts); throughput = 64 such requests at once
(output tok/s); prefill = one 1,024-token prompt (prompt tok/s); RSS after loading and at the
end (peak). `--dtype auto` is each tier's own choice (bfloat16 only with a bf16 dot product);
`--matmul-tokens`: the --quantized-matmul-tokens values to run each with (auto: the default).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def measure(tier: str, dtype: str, matmul_tokens: str) -> dict:
    """In the child: load the default model on `tier` and time the three workloads."""
    import random

    from pagewire import LLM, SamplingParams
    from pagewire.options import tokens_or_auto
    llm = LLM(kernels=tier, dtype=dtype, max_model_len=2048, kv_cache_memory=1 << 30,
              enable_prefix_caching=False,
              quantized_matmul_tokens=tokens_or_auto(matmul_tokens))
    out = {"backend": llm.runner.model.ops.backend, "dtype": llm.config.model.dtype,
           "rss_loaded_mb": rss_mb()}
    rng = random.Random(0)
    prompt = lambda n: {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([prompt(128)], params)                                 # warm-up
    for name, prompts, sp, per in (
            ("single_tok_s", [prompt(128)], params, "out"),
            ("throughput_tok_s", [prompt(128) for _ in range(64)], params, "out"),
            ("prefill_tok_s", [prompt(1024)], SamplingParams(max_tokens=1), "in")):
        start = time.perf_counter()
        llm.generate(prompts, sp)
        seconds = time.perf_counter() - start
        tokens = sum(len(p["prompt_token_ids"]) if per == "in" else sp.max_tokens
                     for p in prompts)
        out[name] = round(tokens / seconds, 1)
    out["rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    from pagewire.kernels import tiers
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", default=",".join(tiers.runnable()))
    ap.add_argument("--dtypes", default="auto")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--matmul-tokens", default="auto")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    print("| tier (backend, dtype) | single stream | 64 x 128/128 | prefill 1,024 | RSS loaded / peak |")
    print("|---|---|---|---|---|")
    for _ in range(args.runs):
        for tier in args.tiers.split(","):
            for dtype, tokens in ((d, t) for d in args.dtypes.split(",")
                                  for t in args.matmul_tokens.split(",")):
                proc = subprocess.run([sys.executable, __file__, "--child", tier, dtype, tokens],
                                      capture_output=True, text=True)
                if proc.returncode:
                    print(f"| {tier} {dtype}: failed: {proc.stderr[-500:]} |")
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                shown = "" if tokens == "auto" else f", matmul tokens {tokens}"
                print(f"| {tier} ({r['backend']}, {r['dtype']}{shown}) | {r['single_tok_s']} tok/s | "
                      f"{r['throughput_tok_s']} tok/s | {r['prefill_tok_s']} tok/s | "
                      f"{r['rss_loaded_mb']:.0f} / {r['rss_peak_mb']:.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
