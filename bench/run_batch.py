"""`pagewire run-batch` against `vllm run-batch` on the same file and model, one after the
other, each the whole command (start-up included) and its output tokens over that time.

    python bench/run_batch.py [--lines 1000] [--max-tokens 64] [--model DIR] [--skip-vllm]

The file: --lines chat requests of short varied prompts, greedy, --max-tokens each with
ignore_eos (every line generates exactly that many). The model: the default model as the
Hugging Face bfloat16 directory the vLLM peer loads (../shared/peers/vllm-cpu.sh model), so
both engines read the same weights. vLLM computes in $VLLM_DTYPE (bfloat16 by default).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PEER = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peers", "vllm-cpu.sh")


def write_file(path: str, lines: int, max_tokens: int, model: str) -> None:
    with open(path, "w") as f:
        for i in range(lines):
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "messages": [
                        {"role": "user", "content": f"Write about topic number {i}: "
                                                    f"{'a story' if i % 2 else 'a poem'}."}]}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


def output_tokens(path: str) -> int:
    total = 0
    with open(path) as f:
        for raw in f:
            answer = json.loads(raw)
            response = answer.get("response") or {}
            total += ((response.get("body") or {}).get("usage") or {}).get(
                "completion_tokens", 0)
    return total


def timed(command: list[str], out: str) -> tuple[float, int]:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, output_tokens(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--ours", default="", help="more `pagewire run-batch` options, one string")
    ap.add_argument("--theirs", default="", help="more `vllm run-batch` options, one string")
    args = ap.parse_args()
    model = args.model or subprocess.run(["bash", PEER, "model"], check=True,
                                         capture_output=True, text=True).stdout.split()[-1]
    work = tempfile.mkdtemp(prefix="run-batch-")
    inp = os.path.join(work, "in.jsonl")
    write_file(inp, args.lines, args.max_tokens, model)
    ours_out, theirs_out = os.path.join(work, "ours.jsonl"), os.path.join(work, "vllm.jsonl")
    ours = timed([sys.executable, "-m", "pagewire.cli", "run-batch", "-i", inp, "-o", ours_out,
                  model, "--max-model-len", "2048", "--served-model-name", model,
                  *args.ours.split()],
                 ours_out)
    print(f"pagewire run-batch: {ours[1]} tokens in {ours[0]:.1f} s = {ours[1] / ours[0]:.1f} "
          f"output tok/s")
    if args.skip_vllm:
        return
    theirs = timed(["bash", PEER, "exec", "vllm", "run-batch", "-i", inp, "-o", theirs_out,
                    "--model", model, "--dtype", os.environ.get("VLLM_DTYPE", "bfloat16"),
                    "--max-model-len", "2048", *args.theirs.split()], theirs_out)
    print(f"vllm run-batch:     {theirs[1]} tokens in {theirs[0]:.1f} s = "
          f"{theirs[1] / theirs[0]:.1f} output tok/s")
    print(f"ratio (output tok/s): {(ours[1] / ours[0]) / (theirs[1] / theirs[0]):.2f}x")


if __name__ == "__main__":
    main()
