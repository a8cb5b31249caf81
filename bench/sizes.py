"""pagewire at the sizes people serve, side by side with llama.cpp and vLLM's CPU build on the
same files (bench/real_shapes.py writes them: random weights of real shapes, real block
formats, the default tokenizer):

    python bench/sizes.py --shape llama-3.2-1b [--formats Q4_0,Q4_K_M,Q8_0,bf16]
                          [--peers llamacpp,vllm] [--only single,prefill,batch]
                          [--pagewire-args "..."] [--activations exact,int8-all]

Per format: a single stream of 128 prompt then 128 generated tokens (output tok/s), its
decode alone (tok/s of 127 tokens after the first; llama.cpp's tg128), a 1,024-token
prefill (tok/s) and, for the bf16 directory and the GGUF formats, 32 x 128/128
offline (output tok/s). llama.cpp runs `llama-bench` on the GGUF files (-pg 128,128: the same
256 tokens; -p 1024), vLLM its `bench latency|throughput` on the bf16 directory. Beside each
figure its ceiling: a single stream's bytes a token (the weights pagewire reads) over the
machine's read bandwidth, measured here; a batch's FLOPs over the bfloat16 GEMM peak oneDNN
reaches here (float32 on an AVX2-only core, where neither engine has a bfloat16 GEMM). One
run of each, in turn: compare within a run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from compare import PAGEWIRE, PEER   # noqa: E402
from real_shapes import model_path  # noqa: E402

from pagewire.testing.real_shapes import SHAPES, tensor_plan   # noqa: E402

LLAMACPP = os.path.join(os.path.dirname(PEER), "llamacpp.sh")
THREADS = str(os.cpu_count())


VOCAB = 49152                   # the default tokenizer's (real_shapes writes it)


def weight_count(shape: str) -> int:
    """The Linears' weights a token multiplies (the LM head included, the embedding not; of a
    mixture of experts' stacks, the share of experts a token takes): 2 FLOPs each."""
    gpt_oss = SHAPES[shape]["architecture"] == "GptOssForCausalLM"   # written MXFP4 only
    plan = tensor_plan(SHAPES[shape], "MXFP4" if gpt_oss else "Q4_0", VOCAB)
    tied = SHAPES[shape]["tie_word_embeddings"]
    return int(sum(d[0] * d[1] if len(d) == 2 else d[0] * d[1] * d[2] * _taken(shape)
                   for name, _, d, _ in plan if len(d) > 1
                   and (tied or not name.endswith(("embed_tokens.weight", "embed_in.weight")))))


def _taken(shape: str) -> float:
    """The share of a mixture's experts a token takes (1: a dense model)."""
    s = SHAPES[shape]
    experts = s.get("num_experts") or s.get("num_local_experts")   # gpt-oss's name
    return s["num_experts_per_tok"] / experts if experts else 1.0


def token_bytes(path: str, shape: str) -> int:
    """Bytes a single stream's token reads of a GGUF file: every tensor's but an untied
    embedding's (a row of it) and a mixture's expert stacks (3-D), of which the share a token
    takes (its ceiling's bytes)."""
    from pagewire.gguf_header import GGML_TYPES, read_gguf_header
    tensors = read_gguf_header(path).tensors
    total = 0.0
    for t in tensors.values():
        if t.name == "token_embd.weight" and "output.weight" in tensors:
            continue
        _, block, size = GGML_TYPES[t.ggml_type]
        nbytes = int(np.prod(t.shape)) // block * size
        total += nbytes * (_taken(shape) if len(t.shape) == 3 else 1.0)
    return int(total)


def read_bandwidth() -> float:
    """Bytes a second a sum over 2 GiB reads (all threads): the single stream's ceiling."""
    x = torch.ones(2**29, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.nbytes / best


def gemm_dtype() -> torch.dtype:
    """bfloat16 where oneDNN multiplies it natively (what `--dtype auto` picks there), else
    float32: an AVX2-only core has no bfloat16 GEMM, and the engines run float32 on it."""
    return torch.bfloat16 if torch.backends.mkldnn.is_available() and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def gemm_peak() -> float:
    """FLOP/s of oneDNN's GEMM in gemm_dtype() on a packed 4096 x 4096 weight at 512 tokens."""
    dtype = gemm_dtype()
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(4096, 4096).to(dtype), 512)
    x = torch.randn(512, 4096).to(dtype)
    run = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    run()
    return 2 * 512 * 4096 * 4096 / min(_timed(run) for _ in range(5))


GEMM = "bf16" if gemm_dtype() == torch.bfloat16 else "float32"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _run(cmd: list[str], pattern: str) -> float:
    out = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(pattern, out.stdout + out.stderr)
    if not m:
        sys.exit(f"{' '.join(cmd[:4])}: no {pattern!r} in\n{(out.stdout + out.stderr)[-2000:]}")
    return float(m.group(1))


# engine flags every pagewire run takes (--pagewire-args: "--quantized-activations
# int8-prefill", ...)
PAGEWIRE_ARGS: list[str] = []


def pagewire_latency(path: str, input_len: int, output_len: int) -> float:
    """Seconds for one request of input_len then output_len tokens."""
    return _run([*PAGEWIRE, "bench", "latency", "--model", path, "--input-len", str(input_len),
                 "--output-len", str(output_len), "--batch-size", "1", "--num-iters", "2",
                 "--num-iters-warmup", "1", "--max-model-len", "2048",
                 "--no-enable-prefix-caching",        # each iteration computes its prompt
                 *PAGEWIRE_ARGS], r"Avg latency: ([\d.]+) seconds")


def pagewire_batch(path: str) -> float:
    return _run([*PAGEWIRE, "bench", "throughput", "--model", path, "--dataset-name", "random",
                 "--random-input-len", "128", "--random-output-len", "128", "--num-prompts", "32",
                 "--max-model-len", "2048", *PAGEWIRE_ARGS], r"([\d.]+) output tokens/s")


def llamacpp(path: str, args: list[str]) -> float:
    """llama-bench's tokens a second for one test (-pg or -p)."""
    tool = subprocess.run(["bash", LLAMACPP, "bin", "llama-bench"], capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]
    out = subprocess.run([tool, "-m", path, "-t", THREADS, "-r", "2", "-o", "json", *args],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)[-1]["avg_ts"]


def vllm(kind: str, path: str, args: list[str]) -> float:
    dtype = os.environ.get("VLLM_DTYPE", "bfloat16")
    pattern = r"Avg latency: ([\d.]+) seconds" if kind == "latency" else r"([\d.]+) output tokens/s"
    return _run(["bash", PEER, "exec", "vllm", "bench", kind, "--model", path, "--dtype", dtype,
                 "--max-model-len", "2048", "--no-enable-prefix-caching", *args], pattern)


def vllm_latency(path: str, input_len: int, output_len: int) -> float:
    """Seconds for one request, as pagewire_latency measures it."""
    return vllm("latency", path, ["--input-len", str(input_len), "--output-len", str(output_len),
                                  "--batch-size", "1", "--num-iters", "2",
                                  "--num-iters-warmup", "1"])


def measure(shape: str, fmt: str, peers: set[str], only: set[str], ceilings: dict,
            activations: list[str | None]) -> None:
    path = model_path(shape, fmt)
    gguf = fmt != "bf16"
    weights = weight_count(shape)
    size = token_bytes(path, shape) if gguf else sum(os.path.getsize(os.path.join(path, f))
                                                     for f in os.listdir(path)
                                                     if f.endswith(".safetensors"))
    print(f"\n{shape} {fmt}: {size / 1e9:.2f} GB a token, {weights / 1e9:.2f} G weights; "
          f"single stream ceiling {ceilings['bandwidth'] / size:.1f} tok/s "
          f"(a token's bytes over {ceilings['bandwidth'] / 1e9:.0f} GB/s)", flush=True)
    for name, (label, ours_fn, peer_fns, digits, bound) in _workloads(path).items():
        if name not in only:
            continue
        theirs = {peer: fn() for peer, fn in peer_fns.items()     # llama.cpp: GGUF; vLLM: bf16
                  if peer in peers and (peer == "llamacpp") == gguf}
        for rounding in activations if gguf else [None]:
            ours = _with_activations(rounding, ours_fn)
            share = bound(ours, size, 2 * weights, ceilings)
            named = f" [{rounding}]" if rounding else ""
            line = f"  {label}{named}: pagewire {ours:.{digits}f} tok/s ({share})"
            for peer, rate in theirs.items():
                line += f", {PEER_NAMES[peer]} {rate:.{digits}f} ({ours / rate:.2f}x)"
            print(line, flush=True)


def _with_activations(rounding: str | None, rate_fn) -> float:
    """rate_fn() with pagewire's --quantized-activations `rounding` (None: as PAGEWIRE_ARGS
    say), so that several roundings meet the same peer figure within one run."""
    extra = ["--quantized-activations", rounding] if rounding else []
    PAGEWIRE_ARGS.extend(extra)
    try:
        return rate_fn()
    finally:
        del PAGEWIRE_ARGS[len(PAGEWIRE_ARGS) - len(extra):]


PEER_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM"}


def _bandwidth(rate: float, size: int, flops: int, ceilings: dict) -> str:
    return f"{rate * size / ceilings['bandwidth']:.0%} of the bandwidth ceiling"


def _gemm(rate: float, size: int, flops: int, ceilings: dict) -> str:
    return f"{rate * flops / ceilings['gemm']:.0%} of the {GEMM} GEMM peak"


def _gemm_both(rate: float, size: int, flops: int, ceilings: dict) -> str:
    return (f"{2 * rate * flops / ceilings['gemm']:.0%} of the {GEMM} GEMM peak, prompt "
            "tokens counted")


def _workloads(path: str) -> dict:
    """name -> (label, pagewire's tok/s, {peer: its tok/s}, digits, what bounds it): rates
    are functions, run only for the workloads and peers asked."""
    return {
        "single": ("single 128/128", lambda: 128 / pagewire_latency(path, 128, 128),
                   {"llamacpp": lambda: 128 / (256 / llamacpp(path, ["-p", "0", "-n", "0",
                                                                      "-pg", "128,128"])),
                    "vllm": lambda: 128 / vllm_latency(path, 128, 128)}, 1, _bandwidth),
        "decode": ("decode", lambda: 127 / (pagewire_latency(path, 1, 128)
                                            - pagewire_latency(path, 1, 1)),
                   {"llamacpp": lambda: llamacpp(path, ["-p", "0", "-n", "128"])}, 1, _bandwidth),
        "prefill": ("prefill 1024", lambda: 1024 / pagewire_latency(path, 1024, 1),
                    {"llamacpp": lambda: llamacpp(path, ["-p", "1024", "-n", "0"]),
                     "vllm": lambda: 1024 / vllm_latency(path, 1024, 1)}, 0, _gemm),
        "batch": ("32 x 128/128 output", lambda: pagewire_batch(path),
                  {"vllm": lambda: vllm("throughput", path, [
                      "--dataset-name", "random", "--random-input-len", "128",
                      "--random-output-len", "128", "--num-prompts", "32"])}, 1, _gemm_both),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--formats", default="Q4_0,Q4_K_M,Q8_0,bf16")
    p.add_argument("--peers", default="llamacpp,vllm")
    p.add_argument("--only", default="single,decode,prefill,batch")
    p.add_argument("--pagewire-args", default="", help="engine flags for every pagewire run")
    p.add_argument("--activations", default=None,
                   help="GGUF runs once per --quantized-activations value listed (e.g. "
                        "exact,int8-all), each against the same peer figures")
    a = p.parse_args()
    PAGEWIRE_ARGS.extend(a.pagewire_args.split())
    ceilings = {"bandwidth": read_bandwidth(), "gemm": gemm_peak()}
    print(f"CPU: {_cpu()}; read bandwidth {ceilings['bandwidth'] / 1e9:.1f} GB/s, "
          f"{GEMM} GEMM peak {ceilings['gemm'] / 1e9:.0f} GFLOP/s", flush=True)
    for fmt in a.formats.split(","):
        measure(a.shape, fmt, set(a.peers.split(",")), set(a.only.split(",")), ceilings,
                a.activations.split(",") if a.activations else [None])


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = re.search(r"model name\s*:\s*(.*)", info).group(1)
    family, model = (re.search(rf"{k}\s*:\s*(\d+)", info).group(1) for k in ("cpu family", "model"))
    return f"{name} family {family} model {model}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
