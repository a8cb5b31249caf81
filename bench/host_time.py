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
import os
import random
import sys
import tempfile
import time

from pagewire import LLM, SamplingParams


def tiny_model(path: str) -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import make_tiny_llama                      # the test suite's tiny Llama
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model
    tokenizer = os.environ.get("PAGEWIRE_TEST_TOKENIZER")
    if tokenizer is None:
        tokenizer = os.path.join(path, "tokenizer")
        load_tokenizer(resolve_model(None)).save_pretrained(tokenizer)
    return make_tiny_llama(os.path.join(path, "model"), tokenizer, vocab_size=512,
                           num_layers=1, max_position=2048)


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
