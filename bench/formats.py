"""Each weight format on the default model: quality, speed and memory, one process per format.

    python bench/formats.py [--rounds 2] [--formats gguf,bf16,gptq-v1-4bit-g32,...]
    python bench/formats.py --activations [--rounds 1]


The default model's GGUF is dequantized by transformers and saved as a float32 Hugging Face
directory (bench/quantize_at_load.py float_checkpoint); each Hugging Face format is that
directory rewritten by the packers the test suite uses (actors/testing/checkpoints.py:
round to nearest, the format's own packing), `int8` / `int4` are `--quantization` at load,
`bf16` the float directory in bfloat16 (BF16 tiles), `bf16-onednn` the same on oneDNN
(`--quantized-matmul-tokens 0`), `gguf-A` the GGUF with `--quantized-activations A`.
`--activations` compares the GGUF's roundings of the activations (gguf-int8, gguf-int8-all,
gguf-int8-prefill: int8 in steps of 8+ tokens, so every teacher-forced position here)
against its exact products (`gguf`, the KL reference then instead of bf16): quality and
memory only (the kernels' speed: bench/int8_gemm.py).
Each format runs in a child process, formats in turn (`--rounds` times): resident memory after
loading and one warm-up request, then single-stream decode (128 random prompt tokens, 128
greedy tokens) and 64 such requests at once, output tokens/s. In round 0 also perplexity on
bench/data/declaration.txt (256-token chunks, teacher-forced) and the mean KL divergence of
each position's next-token distribution from the bfloat16 float checkpoint's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))       # bench's own modules

from kv_quant import TEXT, next_token_logprobs               # noqa: E402
from quantize_at_load import float_checkpoint, rate           # noqa: E402

from pagewire import LLM                                      # noqa: E402

WORK = "/tmp/pagewire-bench-formats"
HF_FORMATS = ["gptq-v1-4bit-g32", "gptq-v2-4bit-channel", "gptq-8bit-sym-g32", "awq-g32",
              "compressed-w4a16", "compressed-w8a8", "fp8"]
ALL = ["gguf", "bf16", "bf16-onednn", "int8", "int4", *HF_FORMATS]
ACTIVATIONS = ["gguf-int8", "gguf-int8-all", "gguf-int8-prefill"]


def engine_args(fmt: str) -> tuple[str | None, dict]:
    """(model path, LLM keywords) of a format; HF formats written on first use."""
    if fmt == "gguf":
        return None, {}
    if fmt.startswith("gguf-"):          # gguf-int8, gguf-int8-all, gguf-int8-prefill, gguf-int16
        return None, {"quantized_activations": fmt[len("gguf-"):]}
    if fmt == "bf16-onednn":                 # the float path: no BF16 tiles
        return float_checkpoint(), {"quantized_matmul_tokens": 0}
    if fmt in ("bf16", "int8", "int4"):
        return float_checkpoint(), {} if fmt == "bf16" else {"quantization": fmt}
    path = os.path.join(WORK, fmt)
    if not os.path.isfile(os.path.join(path, "config.json")):
        from pagewire.testing.checkpoints import write_quantized
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(path + "-float", ignore_errors=True)
        shutil.copytree(float_checkpoint(), path)
        write_quantized(path, fmt)
        shutil.rmtree(path + "-float")
    return path, {}


def resident_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child(fmt: str, reference: str | None, speed: bool = True) -> dict:
    path, kw = engine_args(fmt)
    llm = LLM(path, dtype="bfloat16", max_model_len=2048, kv_cache_memory=256 * 2**20,
              enable_prefix_caching=False, max_num_batched_tokens=256, **kw)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(64)]
    if speed:
        rate(llm, prompts[:1])                                  # warm
    out = {"format": fmt, "rss_mb": resident_mb()}
    if reference is not None:
        ids = llm.tokenizer.encode(open(TEXT).read())
        lp = next_token_logprobs(llm, ids)
        target = torch.tensor(ids[1:])
        out["perplexity"] = math.exp(-lp.gather(1, target[:, None]).mean().item())
        if os.path.exists(reference):
            ref = torch.load(reference)
            out["kl"] = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        else:
            torch.save(lp, reference)                # the first format's: the reference
    if speed:
        out["single"] = rate(llm, prompts[:1])
        out["batch64"] = rate(llm, prompts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", default=",".join(ALL))
    ap.add_argument("--activations", action="store_true",
                    help="the GGUF's int8 activations against its exact products")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--reference", help=argparse.SUPPRESS)
    ap.add_argument("--no-speed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.reference, not args.no_speed)),
              flush=True)
        return
    os.makedirs(WORK, exist_ok=True)
    reference = os.path.join(WORK, "reference-logprobs.pt")
    if os.path.exists(reference):
        os.remove(reference)
    first = "gguf" if args.activations else "bf16"          # the KL reference, run first
    chosen = ACTIVATIONS if args.activations else args.formats.split(",")
    formats = [first, *[f for f in chosen if f != first]]
    for r in range(args.rounds):
        for fmt in formats:
            cmd = [sys.executable, __file__, "--child", fmt, *["--no-speed"] * args.activations]
            if r == 0:
                cmd += ["--reference", reference]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")),
                        None)
            if line is None:
                print(f"round {r} {fmt}: failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            res = json.loads(line[7:])
            quality = "" if r else (f"perplexity {res['perplexity']:.3f}, KL vs {first} "
                                    f"{res.get('kl', 0.0):.2e}, ")
            speed = "" if args.activations else (f", single {res['single']:.1f} tok/s, 64 at "
                                                 f"once {res['batch64']:.1f} tok/s")
            print(f"round {r} {fmt}: {quality}RSS {res['rss_mb']:.0f} MB{speed} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
