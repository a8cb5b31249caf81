"""Structured outputs: what a constraint costs.

    python bench/structured.py [--requests 32] [--output 128] [--rounds 2]

1. compile: the llguidance tokenizer built once, then a typical schema compiled cold (a new
   digest each time) and cached (the same one again), as the tokenizer actor does.
2. mask: per step at batch 1, 16 and 64 on the default model's vocabulary (49,152): the
   bitmasks filled (llguidance, on its threads) and applied to the logits (the sampler), at
   a JSON object's start (few tokens allowed) and inside a string (most allowed).
3. throughput: the default model, the same chat prompts asking for a person as JSON, with the
   schema and without, alternating rounds; output tokens per second and their ratio.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pagewire import LLM, SamplingParams, StructuredOutputsParams
from pagewire.executor.grammar_matchers import Matchers
from pagewire.executor.sampler import apply_bitmasks
from pagewire.grammar_compiler import GrammarCompiler
from pagewire.hf_tokenizer import load_tokenizer
from pagewire.model_info import resolve_model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"},
                                            "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"]}


def _ms(f, repeat: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - start) / repeat * 1e3


def bench_compile(tokenizer, info) -> None:
    compiler = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)
    start = time.perf_counter()
    compiler.llg_tokenizer()
    print(f"compile: llguidance tokenizer built once in {time.perf_counter() - start:.2f} s")
    cold = []
    for i in range(20):
        schema = dict(PERSON, title=f"person {i}")       # a new digest: compiled again
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        cold.append(time.perf_counter() - start)
    so = StructuredOutputsParams(json=dict(PERSON, title="person 0"))
    cached = _ms(lambda: compiler.compile(so), 200)
    print(f"compile: schema cold {np.median(cold) * 1e3:.2f} ms (median of 20), "
          f"cached {cached * 1e3:.1f} us")


def bench_masks(tokenizer, info) -> None:
    compiler = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)
    so = StructuredOutputsParams(json=PERSON, compiled=compiler.compile(
        StructuredOutputsParams(json=PERSON)))
    matchers = Matchers(info, info.vocab_size, info.eos_token_ids)
    in_string = tokenizer.encode('{"name": "Ma', add_special_tokens=False)
    for where, prefix in (("object start", []), ("inside a string", in_string)):
        for batch in (1, 16, 64):
            rows = [matchers.start(so, prefix) for _ in range(batch)]
            fill = _ms(lambda: matchers.fill_async(rows).result(), 50)
            masks = matchers.fill_async(rows).result()
            logits = torch.randn(batch, info.vocab_size)
            allowed = int(np.unpackbits(masks[:1].view(np.uint8)).sum())
            apply = _ms(lambda: apply_bitmasks(logits, list(range(batch)), masks), 50)
            print(f"mask: {where:16s} batch {batch:3d}: fill {fill:6.2f} ms, apply "
                  f"{apply:6.2f} ms ({allowed} tokens allowed)")


def bench_throughput(args) -> None:
    llm = LLM(dtype=args.dtype, max_model_len=1024)
    prompts = [[{"role": "user", "content": f"Describe person number {i} (name, age, city, "
                                            "hobbies) as JSON."}] for i in range(args.requests)]
    free = SamplingParams(temperature=0, max_tokens=args.output)
    held = SamplingParams(temperature=0, max_tokens=args.output,
                          structured_outputs=StructuredOutputsParams(json=PERSON))
    llm.chat(prompts[:2], held)                                    # warm: tokenizer, compile
    rates = {"unconstrained": [], "json schema": []}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", free), ("json schema", held)):
            start = time.perf_counter()
            outs = llm.chat(prompts, params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(tokens / elapsed)
            if name == "json schema":
                valid = sum(_parses(o.outputs[0].text) for o in outs)
                print(f"throughput: {name}: {tokens} tokens, {tokens / elapsed:.1f} tok/s, "
                      f"{valid}/{len(outs)} outputs parse")
            else:
                print(f"throughput: {name}: {tokens} tokens, {tokens / elapsed:.1f} tok/s")
    free_rate, held_rate = np.median(rates["unconstrained"]), np.median(rates["json schema"])
    print(f"throughput: json schema / unconstrained = {held_rate / free_rate:.2f}x")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    info = resolve_model(None)
    tokenizer = load_tokenizer(info)
    bench_compile(tokenizer, info)
    bench_masks(tokenizer, info)
    if not args.skip_throughput:
        bench_throughput(args)


if __name__ == "__main__":
    main()
