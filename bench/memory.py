"""What `pagewire serve MODEL` holds: seconds to the first /health 200, the resident memory of
the whole process tree (every actor) and of its largest process (the executor) then, and the
peak while starting; then one 16-token completion.

    python bench/memory.py MODEL [--port 8765] [-- extra serve flags]

With PAGEWIRE_HUGE_PAGES=0 the CPU KV pool is zeroed at start, so the same figures are those
of a full pool; with huge pages (the default) the pool is backed as it fills. Run twice for a
warm start (the second maps the tiles the first cached).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from compare import PAGEWIRE


def tree_rss(pid: int) -> tuple[float, float]:
    """(GiB resident over the process and its descendants, GiB of the largest one), from
    /proc."""
    parents, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/statm") as f:
                rss[int(entry)] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree, grew = tree | more, bool(more)
    sizes = [rss.get(p, 0) for p in tree]
    return sum(sizes) / 2**30, max(sizes) / 2**30


def main() -> None:
    own, extra = (sys.argv[1:], []) if "--" not in sys.argv else \
        (sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:])
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--port", default="8765")
    a = p.parse_args(own)
    start = time.monotonic()
    proc = subprocess.Popen([*PAGEWIRE, "serve", a.model, "--port", a.port, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url, peak = f"http://127.0.0.1:{a.port}", 0.0
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    sys.exit(f"pagewire serve exited with {proc.returncode}")
                peak = max(peak, tree_rss(proc.pid)[0])
                time.sleep(0.5)
        tree, largest = tree_rss(proc.pid)
        print(f"ready in {time.monotonic() - start:.1f} s; tree {tree:.2f} GiB (largest "
              f"{largest:.2f}); peak while starting {max(peak, tree):.2f} GiB", flush=True)
        model = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello " * 20, "max_tokens": 16,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=600).read()
        print(f"after a request: tree {tree_rss(proc.pid)[0]:.2f} GiB")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
