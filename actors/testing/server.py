"""`pagewire serve` and `pagewire router` started as real processes for a test or a benchmark,
listening on 127.0.0.1 and ended by pid; and /proc look-ups of the processes they start."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from pagewire.config import visible_gpus

# Two tensor-parallel ranks need two GPUs (NCCL); with fewer they share the CPU (gloo).
TWO_RANKS = ["-tp", "2"] + (["--device", "cpu"] if visible_gpus() < 2 else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def actor_pids(server) -> dict[str, int]:
    """A running server's live actors by name ("executor 0", "tokenizer 0", ...)."""
    return {cmdline(pid).removeprefix("pagewire: "): pid
            for pid in child_pids(server.proc.pid) if alive(pid)}


def metric(server, name: str) -> float:
    """The first sample of metric `name` on the server's /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class Server:
    def __init__(self, args: list[str], run_parent: str, timeout: float = 180.0,
                 env: dict[str, str | None] | None = None, log: str | None = None):
        """`env` is added to this process's environment for the server (None unsets); `log`:
        a file the server's (every actor's) stderr goes to, rather than this process's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in {**os.environ, "RUNTIME_DIRECTORY": run_parent, **(env or {})}.items()
               if v is not None}
        with open(log, "wb") if log else contextlib.nullcontext() as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagewire.cli", "serve", "--port", str(self.port), *args],
                env=env, stderr=stderr)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("server did not become healthy")
            time.sleep(0.25)

    def healthy(self) -> bool:
        try:
            return self.request("GET", "/health")[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict | None = None) -> tuple[int, dict, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read() or b"{}"), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}"), dict(e.headers)

    def kv_blocks_freed(self, timeout: float = 10.0) -> bool:
        """Whether the KV cache's use (vllm:kv_cache_usage_perc) falls to 0 within `timeout`
        seconds: every block of every request was given back (the scheduler reports it up to
        a second late)."""
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                lines = r.read().decode().splitlines()
            usage = [float(line.rsplit(" ", 1)[1]) for line in lines
                     if line.startswith("vllm:kv_cache_usage_perc{")]
            if usage and max(usage) == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


class Router:
    """`pagewire router` in front of a prefill engine and decode engines (their URLs), or,
    with `args`, the router those flags ask for (`--replicas ...`)."""

    def __init__(self, prefill: str = "", *decode: str, healthy_enough: bool = False,
                 args: list[str] | None = None):
        """healthy_enough: wait only for the router to answer (an engine may be down)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = args if args is not None else ["--prefill", prefill, "--decode", *decode]
        self.proc = subprocess.Popen([sys.executable, "-m", "pagewire.cli", "router", *flags,
                                      "--port", str(self.port)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return                              # every engine answers
            except urllib.error.HTTPError:
                if healthy_enough:                      # 503: the router is up
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("router did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@contextlib.contextmanager
def running_server(args: list[str], env: dict[str, str | None] | None = None,
                   log: str | None = None):
    """A server with its run directory under /tmp (ipc socket paths are length-capped),
    stopped by pid on exit; its stderr into the file `log` where given."""
    with tempfile.TemporaryDirectory(dir="/tmp") as run_parent:
        srv = Server(args, run_parent, env=env, log=log)
        try:
            yield srv
        finally:
            srv.stop()


def openai_client(srv: Server, api_key: str = "unused"):
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key)
