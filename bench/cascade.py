"""Cascade attention (kernels/cascade.py), side by side with plain decode attention.

    python bench/cascade.py kernel [--rows 2,4,8,16,32] [--prefix 64,128,256,512,1024]
                                   [--dtype float32|bfloat16]
    python bench/cascade.py engine [--requests 16] [--prefix 1024] [--tokens 64] [--rounds 2]

`kernel`: one layer's decode attention of B rows under a P-token shared prefix (each row 16
tokens of its own after it), the default model's heads (9 query, 3 KV, head dim 64), a float32
(or --dtype bfloat16) cache, the backend this CPU picks: microseconds a layer plain vs cascade
(30 layers' caches, so the keys come from DRAM as in a real step), best of 5. Where the ratio
crosses 1 sets cascade.CPU_THRESHOLDS.

`engine`: the default model, `--requests` requests under one shared prompt of `--prefix`
tokens (cached by a first request, as an earlier user would leave it), `--tokens` greedy
tokens each, all decoding together: decode tokens/s with cascade forced on (whatever the
backend's thresholds) and off, two engines alive, alternating rounds.
"""
from __future__ import annotations

import argparse
import random
import time

import torch


def kernel(rows: list[int], prefixes: list[int], dtype: str, layers: int = 30) -> None:
    from pagewire.kernels.attention import AttentionBatch
    from pagewire.kernels.cascade import SharedPrefix
    from pagewire.kernels.ops import select_ops
    ops = select_ops(torch.device("cpu"), "auto")
    bs, hq, hkv, d, own = 16, 9, 3, 64, 16
    dt = getattr(torch, dtype)
    print(f"backend {ops.backend}, {torch.get_num_threads()} threads, {dtype} cache")
    print("rows  prefix  plain_us  cascade_us  ratio")
    for p in prefixes:
        for b in rows:
            nb = p // bs
            blocks = nb + b * (own // bs + 1) + 1
            # One cache per layer, as a step reads them: out of the CPU's caches, from DRAM.
            caches = [torch.randn(2, blocks, bs, hkv, d).to(dt) for _ in range(layers)]
            prefix = torch.arange(nb)
            tables = torch.stack([torch.cat([prefix, nb + torch.arange(i * 2, i * 2 + 2)])
                                  for i in range(b)])
            lens = torch.full((b,), p + own, dtype=torch.int64)
            q = torch.randn(b, hq, d).to(dt)
            empty = torch.zeros(0, hkv, d, dtype=dt)

            def step(cascade):
                batch = AttentionBatch(torch.zeros(0, dtype=torch.int64), b, tables, lens, [],
                                       cascade)
                for cache in caches:
                    ops.attention(q, empty, empty, cache, batch, d ** -0.5)
            shared = SharedPrefix(prefix, p, tables[:, nb:].contiguous(), lens - p)
            times = {}
            for name, arg in (("plain", None), ("cascade", shared)):
                step(arg)
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    step(arg)
                    best = min(best, time.perf_counter() - t)
                times[name] = best * 1e6 / layers
            print(f"{b:4d}  {p:6d}  {times['plain']:8.0f}  {times['cascade']:10.0f}  "
                  f"{times['plain'] / times['cascade']:5.2f}x")


def engine(requests: int, prefix: int, tokens: int, rounds: int) -> None:
    from pagewire import LLM, SamplingParams
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(prefix)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(100, 40000) for _ in range(8)]}
               for _ in range(requests)]
    engines = {name: LLM(max_model_len=prefix + tokens + 64, disable_cascade_attn=off,
                         max_num_seqs=max(requests, 16))
               for name, off in (("off", True), ("on", False))}
    # Forced on at any size: the backend's thresholds would keep 16 rows off on CPU.
    engines["on"].runner.model.ops.cascade_thresholds = (2, 16)
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))       # the prompt cached
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    print(f"{requests} requests x {tokens} tokens under a {prefix}-token shared prompt")
    outputs = {}
    for r in range(rounds):
        for name, llm in engines.items():
            llm.generate(prompts, SamplingParams(max_tokens=1))        # prefill their tails
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            print(f"round {r} cascade {name:3s}: {requests * tokens / elapsed:6.1f} tok/s "
                  f"({elapsed:.2f} s)", flush=True)
    same = sum(a == b for a, b in zip(outputs["on"], outputs["off"]))
    print(f"greedy outputs identical on/off: {same}/{requests}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel")
    k.add_argument("--rows", default="2,4,8,16,32")
    k.add_argument("--prefix", default="64,128,256,512,1024")
    k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e = sub.add_parser("engine")
    e.add_argument("--requests", type=int, default=16)
    e.add_argument("--prefix", type=int, default=1024)
    e.add_argument("--tokens", type=int, default=64)
    e.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.what == "kernel":
        kernel([int(x) for x in args.rows.split(",")], [int(x) for x in args.prefix.split(",")],
               args.dtype)
    else:
        engine(args.requests, args.prefix, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
