"""The avx2 tier's int16 GEMM on the GGUF blocks (csrc/quant_gemm_avx2.h) against oneDNN's
float32 GEMM on the dequantized copy, one linear at a time, on the default model's shapes: the
check that tells whether `--quantized-matmul-tokens auto` chose right on this core.

    python bench/int16_gemm.py [--tokens 16,64,512] [--rounds 3]

Loads the default model on the avx2 tier with `--quantized-matmul-tokens 16` (each linear then
holds its blocks and a packed float32 copy), times both paths on layer 0's projections and
the LM head, best of 10 calls a round, the two paths alternating, and prints the core's int16 /
FMA multiply-add ratio (native.Library.int16_mac_ratio) beside the table. Ratios above 1: the
blocks' GEMM is faster. To see an AVX-512 CPU as an AVX2-only one would, run it under
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` (oneDNN then uses AVX2 too).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from pagewire import LLM
from pagewire.kernels import quant


def best_of(fn, calls: int = 10) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,512")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    llm = LLM(kernels="avx2", dtype="float32", max_model_len=1024, kv_cache_memory=1 << 26,
              quantized_matmul_tokens=16)
    model = llm.runner.model
    layer = model.layers[0]
    linears = {"qkv": layer.attn.qkv, "o_proj": layer.attn.o_proj, "gate_up": layer.mlp.gate_up,
               "down": layer.mlp.down, "lm_head": model.lm_head}
    print(f"int16 / FMA multiply-adds on this core: {model.ops.lib.int16_mac_ratio:.2f} "
          f"(auto takes the GEMM from {quant.INT16_GEMM_MIN_RATIO}); "
          f"{torch.get_num_threads()} threads\n")
    print("| linear | " + " | ".join(f"{t} tokens: blocks / oneDNN ms" for t in tokens) + " |")
    print("|---|" + "---|" * len(tokens))
    for name, lin in linears.items():
        cells = []
        for t in tokens:
            x = torch.randn(t, lin.in_features)
            ratios, pair = [], None
            for _ in range(args.rounds):
                blocks = best_of(lambda: quant.matmul(x, lin.quantized))
                lin.quantized_max_tokens = 0          # forward takes the packed float copy
                dense = best_of(lambda: lin(x))
                lin.quantized_max_tokens = 16
                ratios.append(dense / blocks)
                pair = (blocks, dense)
            cells.append(f"{pair[0] * 1e3:.3f} / {pair[1] * 1e3:.3f} "     # the last round's
                         f"({min(ratios):.2f}-{max(ratios):.2f}x)")
        print(f"| {name} {lin.out_features} x {lin.in_features} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
