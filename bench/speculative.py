"""Speculative decoding against none, side by side in one run (two engines, alternating).

    python bench/speculative.py [--config '{"method": "ngram", ...}'] [--rounds 2]

Workloads on the default model, greedy:
- copy: one stream at a time, each asked to repeat or edit a given text or code (the answer
  copies the prompt: n-gram drafts are often right);
- free: one stream at a time, free text (drafts rarely right);
- batch: 64 free-text requests at once (speculation turns itself off above max_batch).
Prints output tokens per second for each engine, the ratio, and the drafts' acceptance.
"""
from __future__ import annotations

import argparse
import json
import time

from pagewire import LLM, SamplingParams

TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long "
        "discussion, the members agreed to increase funding for the public library, to repair "
        "the roof of the community centre, and to plant two hundred trees along the river. The "
        "chair thanked everyone for their patience and closed the meeting at nine o'clock.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
COPY = [f"Repeat the following text exactly, word for word:\n\n{TEXT}",
        f"Rename the function total_price to compute_total in this code and return the whole "
        f"code:\n\n{CODE}",
        f"Copy this paragraph, changing 'Tuesday' to 'Friday':\n\n{TEXT}",
        f"Return this code unchanged:\n\n{CODE}"]
FREE = ["Write a short story about a robot who learns to paint.",
        "Explain how a bicycle stays upright.",
        "Describe a busy market in the morning.",
        "Give advice to someone starting their first job."]


def _chat(llm: LLM, asks: list[str], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": a}] for a in asks], params)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def single_streams(llm: LLM, asks: list[str], max_tokens: int) -> float:
    tokens = seconds = 0.0
    for ask in asks:
        n, s = _chat(llm, [ask], max_tokens)
        tokens, seconds = tokens + n, seconds + s
    return tokens / seconds


def batch(llm: LLM, size: int, max_tokens: int) -> float:
    asks = [f"{FREE[i % len(FREE)]} (variant {i})" for i in range(size)]
    n, s = _chat(llm, asks, max_tokens)
    return n / s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--only", default="copy,free,batch", help="workloads to run")
    args = p.parse_args()
    common = dict(dtype=args.dtype, max_model_len=2048)
    engines = {"plain": LLM(**common), "spec": LLM(**common,
                                                   speculative_config=json.loads(args.config))}
    for llm in engines.values():                     # warm: first-call costs out of the way
        _chat(llm, FREE[:1], 8)
    work = {"copy": lambda e: single_streams(e, COPY, 160),
            "free": lambda e: single_streams(e, FREE, 128),
            "batch": lambda e: batch(e, args.batch, 64)}
    for name, run in work.items():
        if name not in args.only.split(","):
            continue
        rates = {k: [] for k in engines}
        for _ in range(args.rounds):
            for key, llm in engines.items():
                rates[key].append(run(llm))
        plain, spec = (sorted(rates[k])[len(rates[k]) // 2] for k in ("plain", "spec"))
        print(f"{name}: plain {plain:.1f} tok/s, speculative {spec:.1f} tok/s: "
              f"{spec / plain:.2f}x  (runs: {rates})", flush=True)
    d = engines["spec"].scheduler.drafts
    rate = d.num_accepted_tokens / d.num_draft_tokens if d.num_draft_tokens else 0.0
    print(f"drafts: {d.num_drafts} verifications, {d.num_draft_tokens} drafted, "
          f"{d.num_accepted_tokens} accepted ({100 * rate:.0f}%), per position "
          f"{d.accepted_per_pos}")


if __name__ == "__main__":
    main()
