"""Two pagewire replicas behind a router: prefix-aware versus round-robin routing on a
shared-prefix workload, in one run, with vllm-router's policies and `pagewire router`'s.

    python bench/replicas.py [--groups 8] [--prefix 768] [--per-group 6] [--output 16]
        [--router /path/to/vllm-router] [--model PATH] [--rounds 2]
        [--policies vllm:round_robin vllm:cache_aware pagewire:round-robin pagewire:kv-aware]

Starts two `pagewire serve` replicas (one thread each, the default model unless --model, KV
events published on ipc endpoints), then, for each policy in turn (the list, `--rounds`
times), a router over them (`vllm:` vllm-router's policies, `pagewire:` `pagewire router
--replicas`, kv-aware subscribed to the replicas' KV events), and sends `--groups` x
`--per-group` completion requests: each group shares a `--prefix`-token random prefix, each
request adds 16 tokens of its own; requests of all groups interleave, `--concurrency` in
flight. Every round uses fresh prefixes (nothing cached from the last). Prints requests/s,
the time, and the replicas' prefix-cache hit rate per round. vllm-router's rounds need it
installed (`pip install vllm-router`); they are skipped, saying so, when it is not.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from pagewire.testing.server import Server, free_port


def post(url: str, body: dict) -> None:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.status == 200
        r.read()


def prefix_counts(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("vllm:prefix_cache_queries_total", 0.0), \
        values.get("vllm:prefix_cache_hits_total", 0.0)


def router_command(kind: str, policy: str, replicas: list[Server], run_dir: str,
                   args) -> list[str]:
    urls = [r.url for r in replicas]
    if kind == "vllm":
        return [args.router, "--policy", policy, "--worker-urls", *urls]
    events = ["--kv-events", *[f"ipc://{run_dir}/kv{i}" for i in range(len(replicas))],
              "--kv-events-replay", *[f"ipc://{run_dir}/replay{i}" for i in range(len(replicas))]]
    return [sys.executable, "-m", "pagewire.cli", "router", "--policy", policy, "--replicas",
            *urls, *(events if policy == "kv-aware" else [])]


def start_router(command: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(command + ["--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise TimeoutError(f"{command[0]} did not start")


def one_round(url: str, rng: random.Random, args) -> float:
    prefixes = [[rng.randrange(100, 40000) for _ in range(args.prefix)]
                for _ in range(args.groups)]
    bodies = [{"model": "m", "prompt": prefixes[g] + [rng.randrange(100, 40000)
                                                       for _ in range(16)],
               "max_tokens": args.output, "temperature": 0, "ignore_eos": True}
              for _ in range(args.per_group) for g in range(args.groups)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(lambda b: post(url, b), bodies))
    return time.perf_counter() - start


def router_placements(url: str) -> str:
    """`pagewire router`'s count of requests placed by prefix, by load and in turn."""
    with urllib.request.urlopen(url + "/router/state", timeout=10) as r:
        state = json.loads(r.read())
    served = "/".join(str(x["served"]) for x in state["replicas"])
    return f"  (placed {state['placed']}, served {served})"


def replica_args(common: list[str], run_dir: str, i: int) -> list[str]:
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{run_dir}/kv{i}",
              "replay_endpoint": f"ipc://{run_dir}/replay{i}"}
    return common + ["--kv-events-config", json.dumps(events)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix", type=int, default=768)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--router", default=shutil.which("vllm-router") or "vllm-router")
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=[
        "vllm:round_robin", "vllm:cache_aware", "pagewire:round-robin", "pagewire:kv-aware"])
    args = p.parse_args()
    policies = [tuple(x.split(":", 1)) for x in args.policies]
    if any(k == "vllm" for k, _ in policies) and not shutil.which(args.router):
        print(f"{args.router} not found (pip install vllm-router): its policies are skipped")
        policies = [(k, x) for k, x in policies if k != "vllm"]
    run_dir = tempfile.mkdtemp(dir="/tmp")
    common = ([args.model] if args.model else []) + [
        "--served-model-name", "m", "--threads", "1", "--max-model-len", "2048"]
    replicas = [Server(replica_args(common, run_dir, i), run_dir) for i in range(2)]
    rng = random.Random(0)
    try:
        for kind, policy in policies * args.rounds:
            before = [prefix_counts(r.url) for r in replicas]
            proc, url = start_router(router_command(kind, policy, replicas, run_dir, args))
            try:
                elapsed = one_round(url, rng, args)
                placed = router_placements(url) if kind == "pagewire" else ""
            finally:
                proc.terminate()
                proc.wait(10)
            after = [prefix_counts(r.url) for r in replicas]
            queries = sum(a[0] - b[0] for a, b in zip(after, before))
            hits = sum(a[1] - b[1] for a, b in zip(after, before))
            n = args.groups * args.per_group
            print(f"{kind + ':' + policy:22} {n / elapsed:6.2f} req/s  {elapsed:6.1f} s  "
                  f"prefix hit rate {hits / max(queries, 1):.1%}{placed}", flush=True)
    finally:
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    main()
