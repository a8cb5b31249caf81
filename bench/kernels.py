"""CPU kernel and decode-step timings against this machine's measured peaks.

    python bench/kernels.py [--batches 1,8,32,64,128] [--contexts 128,512,2048] [--threads N]

Measures the peaks first (a bf16 matrix product, a large copy), then times each op of the
default model (SmolLM2-135M, bf16, native CPU kernels; its Q4_1/Q8_0 blocks where the
quantized matmul serves the batch size) at every batch size, the paged decode
attention at every (batch, context), and the whole decode step (every layer, the LM head and
greedy sampling; no scheduler or IPC). Prints markdown tables: time, GFLOP/s and GB/s, and the
fraction of the peak the dominant resource reaches.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagewire.kernels import native
from pagewire.kernels.attention import AttentionBatch
from pagewire.kernels.linear import Linear


def timeit(fn, min_time: float = 0.2, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed > min_time and n >= 3:
            return elapsed / n


def peaks() -> tuple[float, float]:
    """Best of five: a bf16 matrix product through oneDNN with a prepacked weight (the path
    the model's linears take) and a 256 MiB copy (bytes read + written). This VM shares its
    host, so single measurements swing by 30%."""
    lin = Linear(2048, 2048, bias=False).to(torch.bfloat16)
    lin.pack(batch_hint=1024)
    x = torch.randn(1024, 2048, dtype=torch.bfloat16)
    src = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    with torch.inference_mode():
        gflops = max(2 * 1024 * 2048 * 2048 / timeit(lambda: lin(x)) / 1e9 for _ in range(5))
    gbps = max(2 * src.numel() / timeit(lambda: dst.copy_(src)) / 1e9 for _ in range(5))
    return gflops, gbps


def load_model():
    from pagewire import LLM
    llm = LLM(max_model_len=4096, kv_cache_memory=6 * 2**30, max_num_seqs=256)
    return llm.runner


def op_rows(runner, batch: int):
    m, cfg = runner.model, runner.model.cfg
    layer = m.layers[0]
    x = torch.randn(batch, cfg.hidden_size, dtype=torch.bfloat16)
    rows = []
    for name, lin in (("qkv", layer.attn.qkv), ("o_proj", layer.attn.o_proj),
                      ("gate_up", layer.mlp.gate_up), ("down", layer.mlp.down),
                      ("lm_head", m.lm_head)):
        inp = torch.randn(batch, lin.in_features, dtype=torch.bfloat16)
        t = timeit(lambda: lin(inp))
        rows.append((name, t, 2 * batch * lin.in_features * lin.out_features,
                     linear_bytes(lin, batch)))
    res = torch.randn_like(x)
    t = timeit(lambda: native.load().add_rms_norm(x, res, layer.input_norm.weight, 1e-5))
    rows.append(("add_rms_norm", t, 5 * x.numel(), 3 * x.numel() * 2))
    qkv = torch.randn(batch, layer.attn.qkv.out_features, dtype=torch.bfloat16)
    pos = torch.randint(0, 1024, (batch,))
    heads = cfg.num_heads + cfg.num_kv_heads
    t = timeit(lambda: native.load().rope_(qkv, heads, cfg.head_dim, m.cos_sin, pos))
    rows.append(("rope", t, 6 * batch * heads * cfg.head_dim, 4 * batch * heads * cfg.head_dim))
    gu = torch.randn(batch, 2 * cfg.intermediate_size, dtype=torch.bfloat16)
    t = timeit(lambda: native.load().silu_and_mul(gu))
    rows.append(("silu_and_mul", t, 4 * gu.numel(), 3 * gu.numel()))
    return rows


def linear_bytes(lin, batch: int) -> int:
    """Bytes of weight a Linear reads for a step of `batch` tokens: its GGUF blocks when the
    quantized matmul serves that size (kernels/quant.py), else its bfloat16 weight."""
    if lin.quantized is not None and batch <= lin.quantized_max_tokens:
        return lin.quantized.nbytes
    return 2 * lin.in_features * lin.out_features


def decode_batch(runner, batch: int, context: int):
    bs = runner.block_size
    width = -(-context // bs)
    blocks = torch.randperm(runner.config.cache.num_kv_blocks)[:batch * width].view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int64)
    slots = blocks[:, -1] * bs + (context - 1) % bs
    return AttentionBatch(slots, batch, blocks, lens, []), blocks, lens


def step_row(runner, batch: int, context: int):
    m, cfg = runner.model, runner.model.cfg
    attn_batch, tables, lens = decode_batch(runner, batch, context)
    ids = torch.randint(100, 40000, (batch,))
    pos = lens - 1

    def step():
        with torch.inference_mode():
            hidden = m(ids, pos, runner.kv_caches, attn_batch)
            m.compute_logits(hidden).argmax(-1)
    t = timeit(step, min_time=0.5)
    linears = [l for l in m.modules() if isinstance(l, Linear)]
    norms = sum(p.numel() for n, p in m.named_parameters() if n.endswith("norm.weight"))
    weight_bytes = 2 * norms + sum(linear_bytes(l, batch) for l in linears)
    kv_bytes = 2 * 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim
    macs = sum(l.in_features * l.out_features for l in linears)      # a token's multiply-adds
    flops = batch * (2 * macs + 4 * cfg.num_layers * context * cfg.num_heads * cfg.head_dim)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16)
    cache = runner.kv_caches[0]
    ta = timeit(lambda: native.load().decode_attention(q, cache[0], cache[1], tables, lens,
                                                cfg.head_dim ** -0.5))
    return t, flops, weight_bytes + kv_bytes, ta, kv_bytes // cfg.num_layers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    peak_gf, peak_gb = peaks()
    print(f"machine: {torch.get_num_threads()} threads; peak bf16 matmul {peak_gf:.0f} GFLOP/s, "
          f"copy {peak_gb:.1f} GB/s (read + write)\n")
    runner = load_model()
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    print("| op | batch | ms | GFLOP/s | GB/s | % of peak |\n|---|---|---|---|---|---|")
    for b in batches:
        for name, t, flops, nbytes in op_rows(runner, b):
            gf, gb = flops / t / 1e9, nbytes / t / 1e9
            print(f"| {name} | {b} | {t * 1e3:.3f} | {gf:.0f} | {gb:.1f} | "
                  f"{max(gf / peak_gf, gb / peak_gb):.0%} |")
    print("\n| batch | context | decode step ms | tok/s | GFLOP/s | GB/s | % of peak | "
          "attention ms/layer | attention GB/s |\n|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        for c in contexts:
            if b * c > runner.config.cache.num_kv_blocks * runner.block_size:
                print(f"| {b} | {c} | (KV pool too small) |||||||")
                continue
            t, flops, nbytes, ta, kv_layer = step_row(runner, b, c)
            gf, gb = flops / t / 1e9, nbytes / t / 1e9
            print(f"| {b} | {c} | {t * 1e3:.2f} | {b / t:.0f} | {gf:.0f} | {gb:.1f} | "
                  f"{max(gf / peak_gf, gb / peak_gb):.0%} | {ta * 1e3:.3f} | "
                  f"{kv_layer / ta / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
