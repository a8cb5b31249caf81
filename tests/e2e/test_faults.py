"""The fault run of issue 48 on a real server: streamed greedy chats under load while the
tokenizer, then the detokenizer, are SIGKILLed. Every request completes with 200 and each
stream's text is the undisturbed run's (nothing lost, nothing repeated); the engine is clean
afterwards. The resend and rebuild logic in-process: tests/actors/test_fault_recovery.py."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from pagewire.testing.server import actor_pids, metric, running_server
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.slow
CHATS, CONCURRENCY, MAX_TOKENS = 32, 8, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_tokenizer_dir):
    # the tokenizer's whole vocabulary: a chat's prompt is text
    model = make_tiny_llama(str(tmp_path_factory.mktemp("tiny")), smol_tokenizer_dir,
                            vocab_size=49152, tie=True, seed=5)
    with running_server([model, "--dtype", "float32", "--served-model-name", "tiny",
                         "--max-model-len", "256", "--warm-spares"]) as srv:
        yield srv


async def _chat(session, url: str, i: int) -> tuple[int, str, str | None]:
    """(status, the streamed text, the finish reason) of one greedy streamed chat."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell story {i}."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    text, finish = "", None
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
        return r.status, text, finish


async def _load(srv, concurrency: int, kills: list[tuple[int, str]] = ()) -> list:
    """Every chat at `concurrency`; each (done, victim) in kills SIGKILLs that actor once
    `done` chats have completed. Returns the results and the pids killed."""
    gate, done, killed = asyncio.Semaphore(concurrency), [0], []

    async def one(session, i):
        async with gate:
            result = await _chat(session, srv.url, i)
        done[0] += 1
        return result

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(one(session, i)) for i in range(CHATS)]
        for after, victim in kills:
            while done[0] < after:
                await asyncio.sleep(0.02)
            pid = actor_pids(srv)[victim]
            os.kill(pid, signal.SIGKILL)
            killed.append((victim, pid))
        return await asyncio.gather(*tasks), killed


def test_a_dead_tokenizer_and_detokenizer_lose_no_request_and_repeat_no_text(server):
    undisturbed, _ = asyncio.run(_load(server, CHATS))
    assert {(status, finish) for status, _, finish in undisturbed} == {(200, "length")}
    assert len({text for _, text, _ in undisturbed}) > CHATS // 2     # distinct answers
    faulty, killed = asyncio.run(_load(server, CONCURRENCY,
                                       [(CHATS // 4, "tokenizer 0"), (CHATS // 2, "detokenizer")]))
    assert faulty == undisturbed                     # status, text and finish, chat by chat
    deadline = time.monotonic() + 30
    while not (server.healthy() and all(actor_pids(server).get(v) not in (None, pid)
                                        for v, pid in killed)):
        assert time.monotonic() < deadline, "the killed actors were not replaced"
        time.sleep(0.1)
    while metric(server, "vllm:num_requests_running") or \
            metric(server, "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "requests or blocks left behind"
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_waiting") == 0
