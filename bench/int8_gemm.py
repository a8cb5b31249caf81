"""The avx512_bf16 tier's int8 GEMM on GGUF blocks (csrc/quant_gemm_vnni.h, vpdpbusd) against
the small int8 kernels it replaces for large steps, the exact (bfloat16 products) kernels and
oneDNN's bfloat16 GEMM on a dense copy, one linear at a time on a 1B model's shapes
(Llama-3.2-1B: hidden 2048, intermediate 8192, 32 + 2 x 8 heads of 64).

    python bench/int8_gemm.py [--tokens 16,64,256,512] [--types Q4_0,Q4_1,Q8_0] [--calls 3]
                              [--threads N]

Random blocks (fp16 scales and minimums in [0.001, 0.011), random quants), bfloat16
activations, best of `--calls` calls a cell. "small" runs the int8 kernels the GEMM replaces
(csrc/quant_int_avx2.h, which pass over every tile once per 4 tokens) by calling them 4 tokens
at a time, below the GEMM's threshold: their work exactly, plus a call's overhead per 4
tokens. GOP/s counts
2 T N K. Needs the avx512_bf16 tier (VNNI). `--threads` (default: torch's) sets torch's
threads, which oneDNN and the native kernels both use; one thread gives a core's rates.
"""
from __future__ import annotations

import argparse

import torch

from int16_gemm import best_of      # bench/ is the script's directory
from pagewire.kernels import native, quant

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192)}
# type: (GGML type, block bytes, fp16 scales before the quants: d, or d and m)
TYPES = {"Q4_0": (quant.Q4_0, 18, 1), "Q4_1": (quant.Q4_1, 20, 2), "Q8_0": (quant.Q8_0, 34, 1)}


def random_blocks(block_bytes: int, rows: int, cols: int, scales: int = 1) -> torch.Tensor:
    """GGUF blocks [rows, cols / 32 * block_bytes]: `scales` fp16 values (d, m), then random
    quants."""
    nb = cols // 32
    raw = torch.randint(0, 256, (rows, nb, block_bytes), dtype=torch.uint8)
    values = torch.rand(rows, nb, scales) * 0.01 + 0.001
    raw[:, :, :2 * scales] = values.half().view(torch.uint8).reshape(rows, nb, 2 * scales)
    return raw.reshape(rows, nb * block_bytes)


def paths(ggml_type: int, raw: torch.Tensor, n: int, k: int, lib) -> dict:
    """name -> a call of x [T, k] bfloat16 through that path."""
    int8 = quant.pack(ggml_type, raw, k, lib, "int8")
    exact = quant.pack(ggml_type, raw, k, lib, "exact")
    dense = torch.randn(n, k).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(dense, 64)
    return {
        "int8 GEMM": lambda x: quant.matmul(x, int8),
        "int8 small": lambda x: [quant.matmul(x[i:i + 4], int8) for i in range(0, len(x), 4)],
        "exact": lambda x: quant.matmul(x, exact),
        "oneDNN bf16": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                     [], ""),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,256,512")
    ap.add_argument("--types", default="Q4_0,Q8_0")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native.load()
    if lib is None or lib.tier != "avx512_bf16":
        raise SystemExit("the int8 GEMM needs the avx512_bf16 tier (VNNI)")
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads; ms (GOP/s); last column: GEMM / oneDNN rate\n")
    print("| type | linear [N x K] | tokens | int8 GEMM | int8 small | exact | oneDNN bf16 | "
          "GEMM / oneDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for qtype in args.types.split(","):
        ggml_type, block_bytes, scales = TYPES[qtype]
        for name, (n, k) in SHAPES.items():
            calls = paths(ggml_type, random_blocks(block_bytes, n, k, scales), n, k, lib)
            for t in tokens:
                x = torch.randn(t, k).bfloat16()
                calls["int8 GEMM"](x)           # the thread pool up
                secs = {path: best_of(lambda: fn(x), args.calls) for path, fn in calls.items()}
                ops = 2 * t * n * k
                cells = [f"{s * 1e3:.2f} ({ops / s / 1e9:.0f})" for s in secs.values()]
                ratio = secs["oneDNN bf16"] / secs["int8 GEMM"]
                print(f"| {qtype} | {name} {n} x {k} | {t} | " + " | ".join(cells) +
                      f" | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
