"""Speculative decoding against none, side by side in one run (two engines, alternating).

    python bench/speculative.py [--config '{"method": "ngram", ...}'] [--rounds 2]

Workloads on the default model, greedy:
- copy: one stream at a time, each asked to repeat or edit a given text or code (the answer
  copies the prompt: n-gram drafts are often right);
- free: one stream at a time, free text (drafts rarely right);
- batch: 64 free-text requests at once (speculation turns itself off above max_batch);
- json: one stream at a time under a JSON schema with long fixed keys (jump-forward: the
  grammar's forced tokens are the drafts); also the forward passes (steps) each engine ran.
Prints output tokens per second for each engine, the ratio, and the drafts' acceptance.
"""
from __future__ import annotations

import argparse
import json
import time

from pagewire import LLM, SamplingParams, StructuredOutputsParams

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


RECORD = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 40},
    "customer_shipping_address": {"type": "string", "maxLength": 60},
    "order_total_in_euros": {"type": "integer", "minimum": 0, "maximum": 100000},
    "order_contains_fragile_items": {"type": "boolean"},
    "preferred_delivery_time_window": {"enum": ["morning before noon", "afternoon after noon"]}},
    "required": ["customer_full_name", "customer_shipping_address", "order_total_in_euros",
                 "order_contains_fragile_items", "preferred_delivery_time_window"],
    "additionalProperties": False}
ORDERS = ["Anna Berg ordered two vases for 120 euros, to be sent to 4 Elm Street, Oslo.",
          "Tom Reed bought a chair for 80 euros; deliver to 9 Bay Road, Cork, afternoons.",
          "Lea Moser wants three glasses (45 euros) sent to 2 Hill Lane, Graz, mornings."]


def _chat(llm: LLM, asks: list[str], max_tokens: int, schema: dict | None = None
          ) -> tuple[int, float]:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True) if schema else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": a}] for a in asks], params)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def single_streams(llm: LLM, asks: list[str], max_tokens: int, schema=None) -> float:
    tokens = seconds = 0.0
    for ask in asks:
        n, s = _chat(llm, [ask], max_tokens, schema)
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
    p.add_argument("--only", default="copy,free,batch,json", help="workloads to run")
    args = p.parse_args()
    common = dict(dtype=args.dtype, max_model_len=2048)
    engines = {"plain": LLM(**common), "spec": LLM(**common,
                                                   speculative_config=json.loads(args.config))}
    for llm in engines.values():                     # warm: first-call costs out of the way
        _chat(llm, FREE[:1], 8)
    work = {"copy": lambda e: single_streams(e, COPY, 160),
            "free": lambda e: single_streams(e, FREE, 128),
            "batch": lambda e: batch(e, args.batch, 64),
            "json": lambda e: single_streams(e, [f"As JSON: {o}" for o in ORDERS], 160,
                                             RECORD)}
    for name, run in work.items():
        if name not in args.only.split(","):
            continue
        rates, steps = {k: [] for k in engines}, {k: 0 for k in engines}
        for _ in range(args.rounds):
            for key, llm in engines.items():
                before = llm.scheduler.step_id
                rates[key].append(run(llm))
                steps[key] += llm.scheduler.step_id - before
        plain, spec = (sorted(rates[k])[len(rates[k]) // 2] for k in ("plain", "spec"))
        print(f"{name}: plain {plain:.1f} tok/s, speculative {spec:.1f} tok/s: "
              f"{spec / plain:.2f}x; forward passes {steps['plain']} vs {steps['spec']} "
              f"(runs: {rates})", flush=True)
    d = engines["spec"].scheduler.drafts
    rate = d.num_accepted_tokens / d.num_draft_tokens if d.num_draft_tokens else 0.0
    print(f"drafts: {d.num_drafts} verifications, {d.num_draft_tokens} drafted, "
          f"{d.num_accepted_tokens} accepted ({100 * rate:.0f}%), per position "
          f"{d.accepted_per_pos}")


if __name__ == "__main__":
    main()
