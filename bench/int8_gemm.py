"""The int8 GEMM on GGUF blocks (csrc/quant_gemm_vnni.h's vpdpbusd on avx512_bf16,
csrc/quant_gemm_int8_avx2.h's vpmaddubsw below it) against the small int8 kernels it replaces
for large steps, the exact kernels, the int16 GEMM (avx2 tier) and oneDNN's GEMM on a dense
copy (bfloat16 where the core has a bfloat16 dot product, else float32), one linear at a time
on a 1B model's shapes (Llama-3.2-1B: hidden 2048, intermediate 8192, 32 + 2 x 8 heads of 64).

    python bench/int8_gemm.py [--tokens 16,64,256,512] [--types Q4_0,Q4_1,Q8_0] [--calls 3]
                              [--threads N]

Random blocks (fp16 scales and minimums in [0.001, 0.011), random quants), activations in
the dense GEMM's dtype, best of `--calls` calls a cell. "small" runs the int8 kernels the GEMM replaces
(csrc/quant_int_avx2.h, which pass over every tile once per 4 tokens) by calling them 4 tokens
at a time, below the GEMM's threshold: their work exactly, plus a call's overhead per 4
tokens. GOP/s counts
2 T N K. `--threads` (default: torch's) sets torch's
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


def paths(ggml_type: int, raw: torch.Tensor, n: int, k: int, lib, dtype) -> dict:
    """name -> a call of x [T, k] (`dtype`) through that path."""
    packed = {r: quant.pack(ggml_type, raw, k, lib, r) for r in ("int8", "exact", "int16")}
    dense = torch.randn(n, k).to(dtype)
    onednn = torch.ops.mkldnn._reorder_linear_weight(dense, 64) if dtype == torch.bfloat16 \
        else None
    calls = {
        "int8 GEMM": lambda x: quant.matmul(x, packed["int8"]),
        "int8 small": lambda x: [quant.matmul(x[i:i + 4], packed["int8"])
                                 for i in range(0, len(x), 4)],
        "exact": lambda x: quant.matmul(x, packed["exact"]),
        "int16": lambda x: quant.matmul(x, packed["int16"]),
        "oneDNN": (lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
        if onednn is not None else (lambda x: torch.nn.functional.linear(x, dense)),
    }
    if lib.tier != "avx2":
        del calls["int16"]     # the avx2 tier's GEMM from 12 tokens (csrc/quant_gemm_avx2.h)
    return calls


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
    if not quant.available(lib):
        raise SystemExit("no quantized matmuls in this CPU's library")
    dtype = torch.bfloat16 if lib.bf16_dot else torch.float32
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    print(f"{lib.tier}, {torch.get_num_threads()} threads, oneDNN {dtype}; ms (GOP/s); last "
          "column: int8 GEMM / oneDNN rate\n")
    header = False
    for qtype in args.types.split(","):
        ggml_type, block_bytes, scales = TYPES[qtype]
        for name, (n, k) in SHAPES.items():
            calls = paths(ggml_type, random_blocks(block_bytes, n, k, scales), n, k, lib, dtype)
            if not header:
                print("| type | linear [N x K] | tokens | " + " | ".join(calls) +
                      " | GEMM / oneDNN |\n" + "|---" * (len(calls) + 4) + "|")
                header = True
            for t in tokens:
                x = torch.randn(t, k).to(dtype)
                calls["int8 GEMM"](x)           # the thread pool up
                secs = {path: best_of(lambda: fn(x), args.calls) for path, fn in calls.items()}
                ops = 2 * t * n * k
                cells = [f"{s * 1e3:.2f} ({ops / s / 1e9:.0f})" for s in secs.values()]
                ratio = secs["oneDNN"] / secs["int8 GEMM"]
                print(f"| {qtype} | {name} {n} x {k} | {t} | " + " | ".join(cells) +
                      f" | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
