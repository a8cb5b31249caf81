"""The first request of an unloaded model, load included: `pagewire serve --models-dir` against
llama.cpp's router mode (`llama-server --models-dir`) on the same GGUF, in one run.

    python bench/model_load.py [--shape llama-3.2-1b] [--format Q4_0] [--runs 3]

Both servers start over a directory holding one random-weight GGUF of a real shape
(bench/real_shapes.py) and nothing loaded. Each run asks for a 16-token greedy completion of
a 32-token prompt naming the model, timed from the request to the answer (the model's load
and its first tokens), then unloads it (`POST /models/unload`, both servers' route) and waits
until it is gone. The first run reads the file from disk as the page cache left it; later
runs find it cached. Prints each run and the medians, and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from real_shapes import model_path

from pagewire.testing.server import free_port

LLAMACPP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                        "peers", "llamacpp.sh")


def call(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def wait_up(url: str, proc: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            call(url + "/health", timeout=2)
            return
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.2)
    raise TimeoutError(url)


def model_state(url: str, name: str) -> str:
    for m in call(url + "/models")["data"]:
        if m["id"] == name:
            status = m.get("status", {})
            return status.get("value", "") if isinstance(status, dict) else str(status)
    return "absent"


def first_requests(url: str, name: str, runs: int) -> list[float]:
    prompt = " ".join(["word"] * 32)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call(url + "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 16,
                                       "temperature": 0})
        times.append(time.perf_counter() - start)
        call(url + "/models/unload", {"model": name})
        deadline = time.monotonic() + 60
        while model_state(url, name) not in ("unloaded", "absent") and \
                time.monotonic() < deadline:
            time.sleep(0.2)
    return times


def run_server(command: list[str], runs: int, name: str, env: dict | None = None) -> list[float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([*command, "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url, proc)
        ids = [m["id"] for m in call(url + "/models")["data"]]
        name = next((i for i in ids if name in i), name)    # each server's own naming
        return first_requests(url, name, runs)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--format", default="Q4_0")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    path = model_path(args.shape, args.format)
    folder = tempfile.mkdtemp(prefix="pagewire-models-")
    name = os.path.basename(path)[:-len(".gguf")]
    os.symlink(path, os.path.join(folder, os.path.basename(path)))
    threads = str(os.cpu_count())
    ours = run_server([sys.executable, "-m", "pagewire.cli", "serve", "--models-dir", folder,
                       "--max-model-len", "2048", "--kv-cache-memory", "256MiB"],
                      args.runs, name)
    server = subprocess.run(["bash", LLAMACPP, "bin", "llama-server"], capture_output=True,
                            text=True, check=True).stdout.strip()
    theirs = run_server([server, "--models-dir", folder, "--host", "127.0.0.1", "-c", "2048",
                         "-t", threads, "--models-max", "1"], args.runs, name)
    print(f"{args.shape} {args.format} ({os.path.getsize(path) / 2**20:.0f} MiB): first request"
          f" of an unloaded model (load + 32-token prompt + 16 tokens), {args.runs} runs")
    print(f"  pagewire --models-dir: {', '.join(f'{t:.2f}' for t in ours)} s, "
          f"median {statistics.median(ours):.2f}")
    print(f"  llama.cpp router:      {', '.join(f'{t:.2f}' for t in theirs)} s, "
          f"median {statistics.median(theirs):.2f}")
    print(f"  ratio (llama.cpp / pagewire): "
          f"{statistics.median(theirs) / statistics.median(ours):.2f}x")


if __name__ == "__main__":
    main()
