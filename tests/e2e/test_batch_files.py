"""Batch files: OpenAI's /v1/files and /v1/batches through the openai client (each answer
the route's own, files and batches each key's alone, a cancel keeping what finished), and
`pagewire run-batch` on a file of 200 lines killed by pid mid-run and resumed (each custom_id
answered exactly once, every answer whole)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from pagewire.testing.server import alive, child_pids, openai_client, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


def line(i: int, max_tokens: int = 6, url: str = "/v1/chat/completions") -> dict:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    if url == "/v1/completions":
        body["prompt"] = f"Number {i} is"
    else:
        body["messages"] = [{"role": "user", "content": f"Say the number {i}."}]
    return {"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = tmp_path_factory.mktemp("files")
    with running_server(["--max-model-len", "512", "--kv-cache-memory", "64MiB",
                         "--api-key", "k1", "--api-key", "k2", "--files-dir", str(files),
                         "--files-max-bytes", "200KiB", "--batch-concurrency", "4"]) as srv:
        yield srv


def wait_for(client, batch_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return batch
        time.sleep(0.2)


def test_a_batch_answers_each_line_as_its_route_does(server):
    client = openai_client(server, "k1")
    lines = [line(i) for i in range(6)] + [line(6, url="/v1/completions"), "not json"]
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = wait_for(client, client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions",
        completion_window="24h").id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (8, 6, 2)
    answers = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    direct = client.chat.completions.create(**lines[3]["body"])
    (three,) = [a for a in answers if a["custom_id"] == "r3"]
    assert three["response"]["status_code"] == 200
    assert three["response"]["body"]["choices"][0]["message"]["content"] == \
        direct.choices[0].message.content
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(e["error"]["code"] for e in errors) == ["invalid_request", "invalid_url"]
    assert batch.id in [b.id for b in client.batches.list().data]


def test_files_and_batches_are_each_keys_alone(server):
    mine, other = openai_client(server, "k1"), openai_client(server, "k2")
    upload = mine.files.create(file=("in.jsonl", io.BytesIO(jsonl([line(1)]))), purpose="batch")
    assert mine.files.retrieve(upload.id).bytes == len(jsonl([line(1)]))
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    batch = mine.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    wait_for(mine, batch.id)
    assert mine.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve(upload.id)


def test_a_cancelled_batch_keeps_what_finished_and_frees_its_blocks(server):
    client = openai_client(server, "k1")
    lines = [line(i, max_tokens=200) for i in range(40)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    time.sleep(1.0)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled"
    assert cancelled.request_counts.completed < 40
    assert server.kv_blocks_freed()


@pytest.mark.parametrize("upload, status, param", [
    ({"purpose": "fine-tune"}, 400, "purpose"),
    ({"purpose": "batch", "size": 300 * 1024}, 413, None),           # past --files-max-bytes
])
def test_bad_uploads_are_openai_errors(server, upload, status, param):
    client = openai_client(server, "k1")
    data = b"x" * upload.get("size", 10)
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose=upload["purpose"])
    assert e.value.status_code == status and e.value.body["param"] == param
    assert server.healthy()


@pytest.mark.parametrize("body, param", [
    ({"input_file_id": "file-missing", "endpoint": "/v1/chat/completions",
      "completion_window": "24h"}, "file_id"),
    ({"input_file_id": "x", "endpoint": "/v1/moderations", "completion_window": "24h"},
     "endpoint"),
    ({"input_file_id": "x", "endpoint": "/v1/chat/completions", "completion_window": "1h"},
     "completion_window"),
    ({"input_file_id": "x", "endpoint": "/v1/chat/completions", "bogus": 1}, None),
])
def test_bad_batches_are_openai_errors(server, body, param):
    code, answer, _ = server.request("POST", "/v1/batches", body, {"Authorization": "Bearer k1"})
    assert 400 <= code < 500 and answer["error"]["param"] == param
    assert server.healthy()


def run_batch(inp: str, out: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagewire.cli", "run-batch", "-i", inp, "-o",
                             out, "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                             "--concurrency", "32"], stderr=subprocess.DEVNULL)


def test_run_batch_resumes_after_a_kill(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(jsonl([line(i, max_tokens=8) for i in range(120)]))
    killed = run_batch(str(inp), str(out))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not out.exists() or
                                           out.read_text().count("\n") < 24):
        time.sleep(0.2)
    family = [killed.pid] + child_pids(killed.pid)
    os.kill(killed.pid, signal.SIGKILL)              # the command alone: its server dies with it
    killed.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(family) == 2 and not any(alive(pid) for pid in family)
    first = out.read_text().count("\n")
    assert 24 <= first < 120
    with open(out, "a") as f:
        f.write('{"custom_id": "r19')                # a line torn by the kill
    assert run_batch(str(inp), str(out)).wait(timeout=300) == 0
    resumed = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(a["custom_id"] for a in resumed) == sorted(f"r{i}" for i in range(120))
    assert all(a["response"]["status_code"] == 200 and
               1 <= a["response"]["body"]["usage"]["completion_tokens"] <= 8 for a in resumed)


def test_run_batch_refuses_a_bad_file_before_starting_an_engine(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(jsonl([line(1), line(1)]))                   # r1 twice
    assert run_batch(str(inp), str(tmp_path / "out.jsonl")).wait(timeout=60) == 2
    inp.write_bytes(jsonl([line(1)]))
    assert run_batch(str(inp), str(tmp_path / "missing" / "out.jsonl")).wait(timeout=60) == 2
