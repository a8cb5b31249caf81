"""Streaming input: time to the first token after the last piece of a prompt streamed in
pieces, against the same prompt sent whole (LLM.generate_streaming vs LLM.generate).

    python bench/streaming_input.py [--tokens 2048] [--pieces 4] [--gap 5] [--rounds 2]

The default model; a fresh random prompt each run (no prefix-cache hits). Pieces arrive
`--gap` seconds apart (a user pasting, an agent's tool output): the engine prefills each while
the next is on its way, so the first token follows the last piece by that piece's prefill.
Whole: the prompt sent at once, the clock started as it is sent.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--pieces", type=int, default=4)
    ap.add_argument("--gap", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from pagewire import LLM, SamplingParams
    llm = LLM(max_model_len=args.tokens + 64)
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(0)
    size = args.tokens // args.pieces

    async def streamed(prompt: list[int]) -> float:
        last = {}

        async def pieces():
            for i in range(args.pieces):
                if i:
                    await asyncio.sleep(args.gap)
                last["at"] = time.perf_counter()
                yield prompt[i * size:(i + 1) * size]
        await llm.generate_streaming(pieces(), params)
        return time.perf_counter() - last["at"]

    print(f"{args.tokens}-token prompt, {args.pieces} pieces {args.gap} s apart, "
          "seconds to the first token")
    for r in range(args.rounds):
        prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        whole = time.perf_counter() - t
        prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
        after_last = asyncio.run(streamed(prompt))
        print(f"round {r}: whole {whole:.2f} s, after the last piece {after_last:.2f} s "
              f"({whole / after_last:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
