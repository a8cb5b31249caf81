"""Supervision with real processes: systemd's notify protocol over a datagram socket made
here, restarts of each kind of actor killed mid-load, the restart budget, draining on SIGTERM,
and no actor outliving a SIGKILLed supervisor."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import tempfile
import time

import openai
import pytest

from pagewire.testing.server import (actor_pids, alive, child_pids, metric, openai_client,
                                     running_server)

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "64MiB"]


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("form", ["path", "abstract"])
def test_notify_socket_gets_ready_watchdog_and_stopping(form):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        if form == "path":
            address = os.path.join(tmp, "notify.sock")
            sock.bind(address)
        else:
            address = f"@pagewire-test-{os.getpid()}"
            sock.bind("\0" + address[1:])
        sock.settimeout(60)
        states: list[str] = []

        def read_until(wanted: str):
            while not any(wanted in s for s in states):
                states.extend(sock.recv(4096).decode().splitlines())

        env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000"}
        with running_server(SMALL, env) as srv:
            read_until("READY=1")
            read_until("WATCHDOG=1")
            srv.stop()
            read_until("STOPPING=1")
        sock.close()
    assert any(s.startswith("STATUS=loading") for s in states)
    assert states.index("READY=1") < states.index("WATCHDOG=1") < states.index("STOPPING=1")


def ask(client, max_tokens: int = 48):
    return client.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    with running_server(SMALL + ["--restart-budget", "10"]) as srv:
        yield srv


# A tokenizer's or the detokenizer's death fails nothing: tests/e2e/test_faults.py.
@pytest.mark.parametrize("victim", ["scheduler", "executor 0", "gateway"])
def test_killed_actor_is_restarted_and_requests_end_cleanly(server, victim):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    before = actor_pids(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, client, 200) for _ in range(4)]
        time.sleep(1.5)                                    # mid-load
        os.kill(before[victim], signal.SIGKILL)
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result().choices[0].finish_reason)
            except openai.APIStatusError as e:             # failed cleanly: error JSON
                assert e.status_code in (500, 503) and e.body["message"]
                outcomes.append(e.status_code)
            except openai.APIConnectionError:              # the gateway itself died
                assert victim == "gateway"
                outcomes.append("disconnected")
    assert len(outcomes) == 4
    wait_for(lambda: victim in actor_pids(server) and actor_pids(server)[victim] != before[victim],
             what=f"{victim} restarted")
    wait_for(lambda: server.healthy(), what="healthy again")
    assert ask(client, 4).choices[0].finish_reason == "length"
    wait_for(lambda: metric(server, "vllm:num_requests_running") == 0
             and metric(server, "vllm:kv_cache_usage_perc") == 0, what="no blocks held")


def test_past_the_restart_budget_the_server_exits_1():
    with running_server(SMALL + ["--restart-budget", "0"]) as srv:
        os.kill(actor_pids(srv)["tokenizer 0"], signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert not [p for p in child_pids(srv.proc.pid) if alive(p)]


def test_sigterm_lets_a_stream_finish_then_stops_everything(tmp_path):
    log = tmp_path / "server.log"
    with running_server(SMALL + ["--drain-timeout", "60"], log=str(log)) as srv:
        children = child_pids(srv.proc.pid)
        client = openai_client(srv)
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=120,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        code, reply, _ = srv.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert code == 503 and reply["error"]["code"] == 503
        chunks += list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert srv.proc.wait(60) == 0
        assert not [p for p in children if alive(p)]
    # the stop is logged, and no actor's interpreter teardown adds Triton's (nanobind's)
    # "leaked instance" warnings to it (process.end_quietly)
    text = log.read_text()
    assert "supervisor INFO stopping: the gateway drains" in text
    assert text.rstrip().endswith("supervisor INFO stopped"), text[-2000:]
    assert "leaked" not in text


def test_sigkill_of_the_supervisor_leaves_no_actor_running():
    with running_server(SMALL) as srv:
        children = child_pids(srv.proc.pid)
        assert len(children) == 5
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        wait_for(lambda: not [p for p in children if alive(p)], timeout=20, what="actors gone")


def test_a_hung_executor_stops_the_watchdog_pings():
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        address = os.path.join(tmp, "notify.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(address)
        env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000",
               "PAGEWIRE_HEARTBEAT_TIMEOUT": "3"}
        with running_server(SMALL, env) as srv:
            def pings_within(seconds: float) -> int:
                sock.settimeout(0.2)
                count, deadline = 0, time.monotonic() + seconds
                while time.monotonic() < deadline:
                    try:
                        count += sock.recv(4096).decode().splitlines().count("WATCHDOG=1")
                    except socket.timeout:
                        pass
                return count
            assert pings_within(3) >= 2
            executor = actor_pids(srv)["executor 0"]
            os.kill(executor, signal.SIGSTOP)           # hung: alive, but its loop is stuck
            try:
                pings_within(5)                          # past the 3 s heartbeat timeout
                assert pings_within(3) == 0
            finally:
                os.kill(executor, signal.SIGCONT)
            assert pings_within(4) >= 2
        sock.close()
