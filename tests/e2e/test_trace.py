"""`pagewire serve --trace DIR` with concurrent requests, then `pagewire trace` and
`pagewire replay` on what it recorded: the replays match; a changed seed diverges at its
request; the admin switch turns recording off and on."""
from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time

import msgspec
import pytest

from pagewire.replay import replay
from pagewire.testing.server import openai_client, running_server
from pagewire.trace_tools import decode
from pagewire.wire.channels import encode
from pagewire.wire.to_scheduler import NewRequest
from pagewire.wire.trace import TraceWriter, read_trace, set_recording, trace_files

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
KEY = {"Authorization": "Bearer k1"}


def pagewire(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagewire.cli", *args], capture_output=True,
                          text=True, timeout=300)


def run_workload(client) -> dict[str, str]:
    """Concurrent requests of every kind the scheduler treats differently; returns the
    response ids of the seeded ones by seed."""
    def completion(seed=None, **kw):
        return client.completions.create(model=MODEL, prompt=f"Once upon a time {seed}",
                                         max_tokens=16, temperature=0.9, seed=seed, **kw).id

    def chat_stream():
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
            temperature=0, max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def abandoned_stream():
        stream = client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=200,
                                           temperature=0, stream=True)
        for _ in zip(range(3), stream):
            pass
        stream.close()                       # the gateway aborts it: an Abort in the trace

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        seeded = {seed: pool.submit(completion, seed) for seed in (7, 8, 9)}
        others = [pool.submit(completion), pool.submit(completion),
                  pool.submit(completion, 11, n=2, logprobs=2),
                  pool.submit(chat_stream), pool.submit(abandoned_stream)]
        for f in others:
            f.result()
        return {seed: f.result() for seed, f in seeded.items()}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(server, trace dir, seeded response ids); the traces flushed (actors flush each second)."""
    directory = str(tmp_path_factory.mktemp("traces") / "run")
    env = {"PAGEWIRE_API_KEY": None, "VLLM_API_KEY": None}
    # Pipelined steps on (the CPU default is off): the replays reproduce two plans in flight,
    # and the offline LLM below runs one plan in flight: outputs must not differ.
    with running_server(["--max-model-len", "512", "--kv-cache-memory", "64MiB",
                         "--trace", directory, "--api-key", "k1", "--async-scheduling"],
                        env) as srv:
        ids = run_workload(openai_client(srv, "k1"))
        time.sleep(2.5)
        yield srv, directory, ids


def test_every_actor_records_privately(traced):
    _, directory, _ = traced
    actors = sorted(read_trace(p)[0].actor for p in trace_files(directory))
    assert actors == ["detokenizer", "executor 0", "gateway", "scheduler", "tokenizer 0"]
    for path in trace_files(directory):
        assert os.stat(path).st_mode & 0o777 == 0o600


# One request of each kind the cores wire (greedy with stop strings and logprobs, seeded
# n > 1, best_of, beams), as HTTP bodies; prompts share no prefix with run_workload's.
SAME_EVERYWHERE = [
    dict(prompt="The three primary colours are", max_tokens=24, temperature=0,
         stop=[".", " and"], logprobs=2),
    dict(prompt="My favourite fruit is", max_tokens=12, temperature=0.9, seed=5, n=2),
    dict(prompt="Rivers flow to the", max_tokens=10, temperature=0.8, seed=3, n=1, best_of=3),
    dict(prompt="A good name for a cat is", max_tokens=8, temperature=0, n=2,
         use_beam_search=True),
]


def test_server_and_offline_llm_give_the_same_outputs(traced):
    """The same requests, one at a time, through the server (two plans in flight) and through
    LLM (the same cores driven in one process, one plan in flight): the same texts, token for
    token, and the same logprobs. The replays below cover these requests too (they run after
    this test)."""
    from pagewire import LLM, SamplingParams
    srv = traced[0]
    served = []
    for body in SAME_EVERYWHERE:
        code, reply, _ = srv.request("POST", "/v1/completions", {"model": MODEL, **body}, KEY)
        assert code == 200, reply
        served.append(reply["choices"])
    llm = LLM(max_model_len=512, kv_cache_memory=64 * 2**20)
    for body, choices in zip(SAME_EVERYWHERE, served):
        params = {k: v for k, v in body.items() if k != "prompt"}
        logprobs = params.pop("logprobs", None)
        (out,) = llm.generate(body["prompt"], SamplingParams(**params, logprobs=logprobs))
        assert [c.text for c in out.outputs] == [c["text"] for c in choices]
        assert [c.finish_reason for c in out.outputs] == [c["finish_reason"] for c in choices]
        if logprobs:
            assert [e.logprob for e in out.outputs[0].logprobs] == \
                choices[0]["logprobs"]["token_logprobs"]
    time.sleep(2.5)                        # the traces flushed for the replays


@pytest.mark.parametrize("actor", ["scheduler", "detokenizer", "tokenizer"])
def test_replay_matches_the_recording(traced, actor):
    result = pagewire("replay", traced[1], "--actor", actor)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(rf"replayed \d+ records of the {actor} .*: no divergence", result.stdout)


def test_changed_seed_diverges_at_that_request(traced, tmp_path, capsys):
    _, directory, ids = traced
    edited = str(tmp_path / "edited")
    shutil.copytree(directory, edited)
    target = ids[8] + "-0"
    (path,) = [p for p in trace_files(edited) if read_trace(p)[0].actor == "scheduler"]
    header, records = read_trace(path)
    records = list(records)
    os.remove(path)
    set_recording(edited, True)
    writer = TraceWriter(edited, header)       # same actor, pid and segment: the same file name
    for r in records:
        msg = decode(r.channel, r.frame)
        if isinstance(msg, NewRequest) and msg.req_id == target:
            msg = msgspec.structs.replace(
                msg, sampling=msgspec.structs.replace(msg.sampling, seed=1234))
        writer.record_message(r.direction, r.channel, msg, encode(msg))
    writer.close()
    assert replay(edited, "scheduler") == 1
    out = capsys.readouterr().out
    assert f"sequences or requests [{target}]" in out and "recorded message:" in out


def test_trace_show_and_stats(traced):
    _, directory, ids = traced
    stats = pagewire("trace", "stats", directory)
    assert stats.returncode == 0, stats.stderr
    count = 8 + len(SAME_EVERYWHERE)        # run_workload's, then the same-outputs test's
    assert re.search(rf"scheduler +in +NewRequest +{count} ", stats.stdout)
    assert "tokenizer TokenizeRequest -> scheduler NewRequest" in stats.stdout
    show = pagewire("trace", "show", directory, "--request", ids[7], "--actor", "scheduler",
                    "--type", "NewRequest")
    (line,) = show.stdout.splitlines()
    assert "scheduler" in line and "<-" in line and ids[7] in line


def test_admin_switch_stops_and_resumes_recording(traced):
    srv, directory, _ = traced
    assert srv.request("GET", "/admin/trace")[0] == 401
    assert srv.request("GET", "/admin/trace", headers=KEY)[1] == {"recording": True,
                                                                   "directory": directory}
    status, reply, _ = srv.request("POST", "/admin/trace", {"enabled": False}, KEY)
    assert status == 200 and reply["recording"] is False
    time.sleep(1.5)                              # each actor looks at the switch once a second
    before = {p: os.path.getsize(p) for p in trace_files(directory)}
    openai_client(srv, "k1").completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    time.sleep(1.5)
    assert {p: os.path.getsize(p) for p in trace_files(directory)} == before
    assert srv.request("POST", "/admin/trace", {"enabled": True}, KEY)[1]["recording"] is True
    time.sleep(1.5)
    openai_client(srv, "k1").completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    time.sleep(1.5)
    assert len(trace_files(directory)) > len(before)      # resumed in new segments
    result = pagewire("replay", directory, "--actor", "scheduler")
    assert result.returncode == 2 and "switched off" in result.stdout
