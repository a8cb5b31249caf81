"""Where the int8 GEMM overtakes the small steps' kernels on avx512_bf16 (csrc/quant_gemm_vnni.h
kGemmFrom): two builds of the library, one whose every step of 1-7 tokens takes the small
kernels (quant_step_vnni.h; -DPW_GEMM_FROM=8) and one whose every step takes the GEMM
(-DPW_GEMM_FROM=1), timed side by side on a 1B model's linears.

    python bench/gemm_from.py [--types Q4_K,Q5_K,Q6_K,Q8_0,...] [--tokens 1,2,3,4,5,6,7,8]

Linears: Llama-3.2-1B's qkv (3072 x 2048), down (2048 x 8192) and gate_up (16384 x 2048), random
blocks (K-quants as superblock tiles, Q6_K and Q5_K as bit planes), three copies each (beyond
the L2 cache, so their tiles stream from memory as a model's do), bfloat16 activations, best
of three passes, the two builds alternating three times. Prints ms for the three linears
together and the GEMM's speed-up; the builds are cached beside the library (first run: two
compiles of ~2 minutes).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import gguf
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pagewire.kernels import gguf_blocks, native, native_api, quant, tiers  # noqa: E402
from pagewire.testing.gguf_writer import random_blocks  # noqa: E402
from tile_rate import best_pass  # noqa: E402  (bench/ is the script's directory)

TIER = "avx512_bf16"
SHAPES = {"qkv": (3072, 2048), "down": (2048, 8192), "gate_up": (16384, 2048)}
TYPES = "Q4_K,Q5_K,Q6_K,Q2_K,IQ4_XS,Q4_0,Q8_0,IQ4_NL,MXFP4"


def variant(gemm_from: int) -> native.Library:
    """The library built with every tile type's GEMM from `gemm_from` tokens."""
    base = native.library_path(TIER)
    target = os.path.join(os.path.dirname(base), f"gemm_from{gemm_from}-{os.path.basename(base)}")
    if not os.path.exists(target):
        print(f"building {target} ...", flush=True)
        native._build(target, [*native._FLAGS, *tiers.compiler_flags(TIER),
                               f"-DPW_GEMM_FROM={gemm_from}"])
    return native.Library(native_api.bind(ctypes.CDLL(target)), TIER)


def weights(qtype: str, lib: native.Library, rng) -> list[list[quant.QuantWeight]]:
    """Three packed copies of each linear of SHAPES, as `lib` packs int8 tiles."""
    ggml_type = int(gguf.GGMLQuantizationType[qtype])
    out = []
    for n, k in SHAPES.values():
        kind, raw = ggml_type, random_blocks(qtype, n, k, rng)
        if kind in gguf_blocks.SUPERBLOCKS:
            kind, raw = gguf_blocks.k_quant_super_blocks(kind, raw)
        out.append([quant.pack(kind, raw, k, lib, "int8") for _ in range(3)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--tokens", default="1,2,3,4,5,6,7,8")
    args = ap.parse_args()
    if TIER not in tiers.runnable():
        sys.exit(f"needs a CPU that runs the {TIER} tier")
    libs = {"small": variant(8), "GEMM": variant(1)}
    tokens = [int(t) for t in args.tokens.split(",")]
    print("type | " + " | ".join(f"{t} tok: small / GEMM ms (x)" for t in tokens))
    for qtype in args.types.split(","):
        packed = {name: weights(qtype, lib, np.random.default_rng(0))
                  for name, lib in libs.items()}
        cells = []
        for t in tokens:
            xs = [torch.randn(t, k).bfloat16() for _, k in SHAPES.values()]
            ms = dict.fromkeys(libs, float("inf"))
            for _ in range(3):
                for name, linears in packed.items():
                    ms[name] = min(ms[name], sum(best_pass(copies, x, 3) / len(copies)
                                                 for copies, x in zip(linears, xs)) * 1e3)
            cells.append(f"{ms['small']:.2f} / {ms['GEMM']:.2f} ({ms['small'] / ms['GEMM']:.2f}x)")
        print(f"{qtype} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
