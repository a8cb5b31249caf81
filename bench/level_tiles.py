"""Level tiles against the int8 tiles of the same values, from DRAM (csrc/quant_tiles.h Levels:
IQ4_NL's, MXFP4's and IQ4_XS's nibbles kept as stored, looked up with vpshufb):

    python bench/level_tiles.py [--types IQ4_NL,MXFP4,IQ4_XS] [--roundings int16,int8,exact]
                                [--tokens 1,2,4,8] [--dtype float32|bfloat16]

Each type's random blocks of a 2048 x 4096 weight, packed 24 times each way (~200 MB of int8
tiles: past any cache), multiplied in turn by activations of `tokens` rows (float32, or
bfloat16: what `--dtype auto` serves on avx512_bf16, whose exact kernels take float32 x as
three bfloat16 parts); the best of three passes. Figures: billions of weights a second
(Gw/s) and the tiles' GB/s. The int8 tiles: Q8_0's, IQ4_XS's int8 superblocks (what a tier
without level tiles packs).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from pagewire.kernels import gguf_blocks, native, quant
from pagewire.testing.gguf_writer import random_blocks

sys.path.insert(0, os.path.dirname(__file__))
from tile_rate import best_pass  # noqa: E402

ROWS, COLS, COUNT = 2048, 4096, 24


class _WithoutLevels:
    """A library that packs as if it lacked level tiles (the avx512_bf16 tier's choice)."""

    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def quant_kind(self, kind: int) -> bool:
        return kind % 100 not in (quant.IQ4_NL, quant.MXFP4, quant.IQ4_XSL) and \
            self.lib.quant_kind(kind)


def blocks(qtype: str, rng) -> tuple[int, torch.Tensor]:
    """(the type pack() takes, blocks) of random weights: MXFP4's exponents inside fp16's."""
    raw = random_blocks(qtype, ROWS, COLS, rng)
    if qtype == "MXFP4":
        raw.view(ROWS, COLS // 32, 17)[..., 0] = torch.from_numpy(
            rng.integers(118, 132, (ROWS, COLS // 32), dtype=np.uint8))
        return quant.MXFP4, raw
    if qtype == "IQ4_XS":
        return gguf_blocks.k_quant_super_blocks(gguf_blocks.IQ4_XS, raw)
    return quant.IQ4_NL, raw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="IQ4_NL,MXFP4,IQ4_XS")
    p.add_argument("--roundings", default="int16,int8,exact")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    lib = native.load()
    if lib is None or not lib.quant_kind(quant.MXFP4):
        raise SystemExit(f"{lib}: no level tiles on this tier")
    rng = np.random.default_rng(0)
    for qtype in args.types.split(","):
        kind, raw = blocks(qtype, rng)
        for rounding in args.roundings.split(","):
            level = [quant.pack(kind, raw.clone(), COLS, lib, rounding) for _ in range(COUNT)]
            int8 = [quant.pack(kind, raw.clone(), COLS, _WithoutLevels(lib), rounding)
                    for _ in range(COUNT)]
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, COLS, dtype=getattr(torch, args.dtype))
                line = f"{qtype} {rounding:5s} {tokens:2d} tokens:"
                rates = []
                for name, ws in (("level", level), ("int8 tiles", int8)):
                    seconds = best_pass(ws, x, 3)
                    rates.append(ROWS * COLS * COUNT / seconds / 1e9)
                    line += (f" {name} {rates[-1]:5.1f} Gw/s "
                             f"({sum(w.nbytes for w in ws) / seconds / 1e9:4.1f} GB/s)")
                print(f"{line}  {rates[0] / rates[1]:.2f}x", flush=True)
            del level, int8


if __name__ == "__main__":
    main()
