"""How fast one token's matmul streams a quantized weight's tiles, per tile format: the
decode step's inner loop, GB/s of tiles and G weights a second.

    python bench/tile_rate.py [--types Q4_K,Q6_K,Q8_0,Q4_0] [--threads 2] [--classic]
                              [--codes] [--rounding exact|int16|int8] [--tier avx2]

A down projection's shape (14336 x 4096, an 8B model's), random blocks, bfloat16 activations,
exact products; four copies of the weight (beyond the L3 cache) multiplied in turn, best of
seven. `--classic` adds the K-quants' classic tiles (float32 scales a block) beside their
superblock tiles; `--codes` Q6_K's and Q3_K's int8 code tiles (Q6_KS) beside the bit planes
a tier keeps them as (Q6_KP, avx512_bf16's); `--rounding int8` rounds the activations per block to int8 (as
--quantized-activations int8 does); `--tier` takes a lower tier's kernels. Compare within
one run: the host's bandwidth varies between runs.
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

ROWS, COLS = 14336, 4096


def packed(qtype: str, classic: bool, lib, rounding: str,
           planes: bool = True) -> quant.QuantWeight:
    import gguf
    kind = int(gguf.GGMLQuantizationType[qtype])
    rng = np.random.default_rng(0)
    if qtype in ("Q4_0", "Q8_0"):
        w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        raw = torch.from_numpy(gguf.quants.quantize(w, kind))
    else:
        raw = random_blocks(qtype, ROWS, COLS, rng)
    if kind in gguf_blocks.SUPERBLOCKS:
        convert = gguf_blocks.k_quant_blocks if classic else gguf_blocks.k_quant_super_blocks
        kind, raw = convert(kind, raw)
    return quant.pack(kind, raw, COLS, lib, rounding, planes)


def rate(weights: list[quant.QuantWeight]) -> float:
    """Seconds a matmul of one token, best of seven passes over the copies."""
    return best_pass(weights, torch.randn(1, COLS).bfloat16(), 7) / len(weights)


def best_pass(weights: list[quant.QuantWeight], x: torch.Tensor, passes: int) -> float:
    """Seconds of the fastest of `passes` passes multiplying x by every weight in turn (after
    one untimed pass)."""
    for w in weights:
        quant.matmul(x, w)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for w in weights:
            quant.matmul(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--classic", action="store_true")
    p.add_argument("--codes", action="store_true")
    p.add_argument("--rounding", default="exact", choices=("exact", "int16", "int8"))
    p.add_argument("--tier", default=None, help="a native tier (default: the CPU's best)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lib = native.load(a.tier)
    for qtype in a.types.split(","):
        variants = [(False, True)]
        if a.classic and qtype.endswith("_K"):
            variants.append((True, True))
        if a.codes and qtype in ("Q3_K", "Q6_K"):
            variants.append((False, False))
        for classic, planes in variants:
            weights = [packed(qtype, classic, lib, a.rounding, planes) for _ in range(4)]
            seconds = rate(weights)
            kind = weights[0].kind % 100
            name = f"{qtype}{' classic' if classic else ''}" + \
                (" planes" if kind == quant.Q6_KP else " codes" if kind == quant.Q6_KS else "")
            print(f"{name}: {weights[0].nbytes / 1e6:.0f} MB in {seconds * 1e3:.2f} ms: "
                  f"{weights[0].nbytes / seconds / 1e9:.1f} GB/s, "
                  f"{ROWS * COLS / seconds / 1e9:.1f} G weights/s ({a.threads} threads, "
                  f"{lib.tier}, {a.rounding})", flush=True)


if __name__ == "__main__":
    main()
