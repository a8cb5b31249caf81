"""Bit planes (csrc/quant_tiles.h Q6_KP, Q5_KP) against the int8 code tiles (Q6_KS, Q5_KS),
both with int8 activations on the avx512_bf16 tier: one linear by step size, or a GGUF's
decode.

    python bench/q6_planes.py [--type Q6_K|Q5_K] [--tokens 1,4,16,64,256] [--threads 2]
    python bench/q6_planes.py --decode FILE.gguf [--activations int8-all]

Linears: a 1B model's down (2048 x 8192), gate_up (16384 x 2048) and v (512 x 2048), random
blocks, three copies each way (beyond the L2 cache), best of five passes, the two
alternating twice. --decode: two engines in this process whose only difference is the
packing of Q6_K and Q5_K (the tile cache off), ms a decoded token (the difference of 8 and
72 generated tokens after a 16-token prompt, best of two), three rounds alternating.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pagewire.kernels import gguf_blocks, native, quant  # noqa: E402
from pagewire.testing.gguf_writer import random_blocks  # noqa: E402
from tile_rate import best_pass  # noqa: E402  (bench/ is the script's directory)

SHAPES = {"down": (2048, 8192), "gate_up": (16384, 2048), "v": (512, 2048)}


def best_ms(weights: list[quant.QuantWeight], x: torch.Tensor) -> float:
    """ms a matmul, the fastest of five passes over the copies (tile_rate.best_pass)."""
    return best_pass(weights, x, 5) / len(weights) * 1e3


def steps(qtype: str, tokens: list[int]) -> None:
    lib = native.load("avx512_bf16")
    rng = np.random.default_rng(0)
    ggml_type = {"Q6_K": gguf_blocks.Q6_K, "Q5_K": gguf_blocks.Q5_K}[qtype]
    for name, (n, k) in SHAPES.items():
        kind, blocks = gguf_blocks.k_quant_super_blocks(ggml_type,
                                                        random_blocks(qtype, n, k, rng))
        weights = {planes: [quant.pack(kind, blocks, k, lib, "int8", planes)
                            for _ in range(3)] for planes in (True, False)}
        for t in tokens:
            x = torch.randn(t, k).bfloat16()
            ms = {p: min(best_ms(w, x) for _ in range(2)) for p, w in weights.items()}
            print(f"{name} {n} x {k}, {t} tokens: planes {ms[True]:.3f} ms, codes "
                  f"{ms[False]:.3f} ms ({ms[False] / ms[True]:.2f}x)", flush=True)


def decode(path: str, activations: str) -> None:
    os.environ["PAGEWIRE_WEIGHT_CACHE"] = "0"      # each engine packs its own tiles
    from pagewire.llm import LLM
    from pagewire.wire.sampling_params import SamplingParams
    stored = dict(quant._STORED_SUPERS)

    def engine(planes: bool) -> LLM:
        quant._STORED_SUPERS.clear()
        quant._STORED_SUPERS.update({t: v for t, v in stored.items()
                                     if planes or t not in (quant.Q6_KS, quant.Q5_KS)})
        return LLM(path, quantized_activations=activations, max_model_len=1024,
                   enable_prefix_caching=False)

    engines = {"planes": engine(True), "codes": engine(False)}
    quant._STORED_SUPERS.update(stored)

    def seconds(llm: LLM, n: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(1000, 1016))}],
                     SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    for llm in engines.values():
        seconds(llm, 4)
    def ms_a_token(llm: LLM) -> float:
        long, short = (min(seconds(llm, n) for _ in range(2)) for n in (72, 8))
        return (long - short) / 64 * 1e3

    for _ in range(3):
        print("  ".join(f"{name} {ms_a_token(llm):.2f} ms a token"
                        for name, llm in engines.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--type", default="Q6_K", choices=("Q6_K", "Q5_K"))
    p.add_argument("--tokens", default="1,4,16,64,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode", metavar="GGUF")
    p.add_argument("--activations", default="int8-all")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.decode:
        decode(a.decode, a.activations)
    else:
        steps(a.type, [int(t) for t in a.tokens.split(",")])


if __name__ == "__main__":
    main()
