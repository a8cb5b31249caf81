"""`pagewire run-batch`: a batch file of OpenAI requests answered by a local server.

    pagewire run-batch -i requests.jsonl -o results.jsonl [MODEL] [serve options]
        [--concurrency N]

It starts `pagewire serve` with the options given (on 127.0.0.1, a free port), sends every
line to its route (batch_lines.py: the same answers a client of the route gets) with up to
--concurrency in flight (its --max-num-seqs by default) so the engine batches them
continuously, appends each answer to the output as it finishes, and stops the server. A batch
job is for throughput: unless --max-num-seqs says otherwise, the server runs 512 sequences a
step (`serve`'s default, 256, favours latency). Run again on the same output, it resumes: the
custom_ids already answered are skipped (a line torn by a kill is redone).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from .batch_lines import BatchFileError, done_ids, read_requests, run_requests
from .process import die_with_parent

START_TIMEOUT_S = 900.0
BATCH_MAX_NUM_SEQS = "512"


def add_command(sub) -> None:
    p = sub.add_parser("run-batch", help="answer a batch file of OpenAI requests (vLLM's "
                       "run-batch)", add_help=True)
    p.add_argument("-i", "--input-file", required=True, help="requests, one JSON a line")
    p.add_argument("-o", "--output-file", required=True, help="answers, appended (resumed)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: the "
                   "server's --max-num-seqs)")


def run(args: argparse.Namespace, serve_argv: list[str]) -> int:
    try:
        with open(args.input_file) as f:
            requests = read_requests(f.read())
        with open(args.output_file, "a"):            # a bad output path fails before the engine
            pass
    except (OSError, BatchFileError) as e:
        print(f"run-batch: {e}", file=sys.stderr)
        return 2
    done = set()
    if os.path.exists(args.output_file):
        with open(args.output_file) as f:
            done, kept = done_ids(f.read())
        with open(args.output_file, "w") as f:       # without a torn last line
            f.write(kept)
    todo = [r for r in requests if r["custom_id"] not in done]
    print(f"run-batch: {len(requests)} requests, {len(done)} already answered",
          file=sys.stderr)
    if not todo:
        return 0
    if not any(a.startswith("--max-num-seqs") for a in serve_argv):
        serve_argv = [*serve_argv, "--max-num-seqs", BATCH_MAX_NUM_SEQS]
    config = _config(serve_argv)
    args.concurrency = args.concurrency or config.scheduler.max_num_seqs
    keys = config.server.api_keys
    with tempfile.TemporaryDirectory(prefix="pagewire-run-batch-") as run_dir:
        server, url = _start_server(serve_argv, run_dir)
        try:
            _answer(url, todo, args, keys[0] if keys else None)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    return 0


def _answer(url: str, todo: list[dict], args, key: str | None) -> None:
    from tqdm import tqdm
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with open(args.output_file, "a") as out, tqdm(total=len(todo), unit="req") as bar:
        def write(line: dict) -> None:
            import json
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
        asyncio.run(run_requests(url, todo, write, args.concurrency, headers,
                                 progress=bar.update))


def _start_server(serve_argv: list[str], run_dir: str) -> tuple[subprocess.Popen, str]:
    """`pagewire serve` on a free loopback port, its log in run_dir (off the progress bar;
    its tail printed if it fails to start); it dies with this process, so a killed
    run-batch leaves no engine behind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = os.path.join(run_dir, "server.log")
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "pagewire.cli", "serve", *serve_argv,
                                   "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=log, stderr=log, preexec_fn=die_with_parent,
                                  env={**os.environ, "RUNTIME_DIRECTORY": run_dir})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    with open(log_path, "rb") as f:
        sys.stderr.write(f.read()[-4000:].decode(errors="replace"))
    raise SystemExit(f"run-batch: the server did not start (exit {server.poll()})")


def _config(serve_argv: list[str]):
    """The started server's options (its keys: --api-key, or the environment's)."""
    from .cli import config_from_args, serve_parser
    return config_from_args(serve_parser().parse_args(serve_argv))
