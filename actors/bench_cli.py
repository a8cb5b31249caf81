"""`pagewire bench throughput` and `pagewire bench latency`: the offline engine measured with
the command shapes and summary lines of `vllm bench`, so the two compare line for line.

    pagewire bench throughput --dataset-name random --random-input-len 128 \\
        --random-output-len 128 --num-prompts 64 [--random-range-ratio R] [--seed S]
    pagewire bench latency --input-len 128 --output-len 128 --batch-size 1 --num-iters 5

The model is the positional MODEL, as for `pagewire serve`, or `--model MODEL`, as for vLLM's
bench commands (giving both, different, is an error).
"""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    vocab_size: int) -> list[tuple[list[int], int]]:
    """vLLM's random dataset shape: lengths uniform in [len*(1-r), len*(1+r)], random ids."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(max(1, int(input_len * (1 - range_ratio))),
                       int(input_len * (1 + range_ratio)) + 1, size=num)
    outs = rng.integers(max(1, int(output_len * (1 - range_ratio))),
                        int(output_len * (1 + range_ratio)) + 1, size=num)
    low = min(100, vocab_size // 4)
    return [(rng.integers(low, vocab_size, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def add_arguments(sub) -> None:
    from .cli import add_engine_args
    tp = sub.add_parser("throughput", help="offline throughput on a random dataset")
    add_engine_args(tp)
    _add_model_flag(tp)
    tp.add_argument("--dataset-name", default="random", choices=["random"])
    tp.add_argument("--random-input-len", type=int, default=1024)
    tp.add_argument("--random-output-len", type=int, default=128)
    tp.add_argument("--random-range-ratio", type=float, default=0.0)
    tp.add_argument("--num-prompts", type=int, default=1000)
    tp.add_argument("--output-json", default=None)
    tp.set_defaults(bench=throughput)
    lat = sub.add_parser("latency", help="latency of one batch, repeated")
    add_engine_args(lat)
    _add_model_flag(lat)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--num-iters", type=int, default=30)
    lat.add_argument("--num-iters-warmup", type=int, default=10)
    lat.add_argument("--output-json", default=None)
    lat.set_defaults(bench=latency)


def _add_model_flag(p) -> None:
    p.add_argument("--model", dest="model_flag", default=argparse.SUPPRESS, metavar="MODEL",
                   help="the model, as vLLM's bench commands take it (same as MODEL)")


def take_model_flag(args: argparse.Namespace) -> None:
    """Move `--model` to the positional MODEL's place (`args.model`, which the configuration
    reads). Raises ValueError when both are given and differ."""
    flag = vars(args).pop("model_flag", None)
    if flag is None:
        return
    positional = getattr(args, "model", None)
    if positional is not None and positional != flag:
        raise ValueError(f"the model is given twice: MODEL {positional!r} and --model {flag!r}")
    args.model = flag


def _llm(args):
    from .cli import config_from_args
    from .llm import LLM
    fields = {k: v for k, v in config_from_args(args).flat().items()
              if k not in ("model", "model_info", "draft_model_info", "run_dir")}
    return LLM(getattr(args, "model", None), **fields)


def throughput(args) -> dict:
    from pagewire.wire.sampling_params import SamplingParams
    llm = _llm(args)
    reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, getattr(args, "seed", 0),
                           llm.config.model.model_info.vocab_size)
    limit = llm.config.model.max_model_len
    reqs = [(p[: limit - o], o) for p, o in reqs]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=o, ignore_eos=True)
              for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p, _ in reqs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"elapsed_time": elapsed, "num_requests": len(reqs),
              "total_num_tokens": prompt_tokens + output_tokens,
              "requests_per_second": len(reqs) / elapsed,
              "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
              "output_tokens_per_second": output_tokens / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    return result


def latency(args) -> dict:
    from pagewire.wire.sampling_params import SamplingParams
    llm = _llm(args)
    rng = random.Random(getattr(args, "seed", 0))
    vocab = llm.config.model.model_info.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
               for _ in range(args.batch_size)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len,
                            ignore_eos=True)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params)
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params)
        latencies.append(time.perf_counter() - start)
    arr = np.array(latencies)
    print(f"Avg latency: {arr.mean()} seconds")
    for pct in (10, 25, 50, 75, 90, 99):
        print(f"{pct}% percentile latency: {np.percentile(arr, pct)} seconds")
    return {"avg_latency": float(arr.mean()), "latencies": latencies,
            "percentiles": {p: float(np.percentile(arr, p)) for p in (10, 25, 50, 75, 90, 99)}}


def run(args) -> int:
    result = args.bench(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
