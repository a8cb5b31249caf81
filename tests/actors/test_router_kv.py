"""`pagewire router --replicas ... --policy kv-aware|round-robin` in front of two fake replicas
(aiohttp test servers answering /v1/completions with their own name, /tokenize, /health),
each publishing KV events with the scheduler's publisher: the router places a request on the
replica whose events say it holds the request's prefix, on the least loaded one when none
does or the loads drift apart, and forgets a replica's blocks on AllBlocksCleared."""
from __future__ import annotations

import argparse
import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pagewire.router import make_app
from pagewire.router_kv_index import ReplicaCache, block_keys
from pagewire.wire.channels import make_run_dir
from pagewire.wire.kv_event_publisher import KvEventPublisher
from pagewire.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 4
PROMPT = list(range(500, 520))            # 5 blocks of 4
TEXT_TOKENS = {"the shared document": PROMPT + [7, 8]}


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU")


def test_a_replica_cache_follows_the_chain_its_events_give():
    cache = ReplicaCache(pending_ttl=0.0, block_size=BS)
    keys = block_keys(PROMPT, BS)
    cache.apply(KVEventBatch(0.0, [stored([11, 12], PROMPT[:8]), stored([13], PROMPT[8:12], 12),
                                   stored([99], [1, 2, 3, 4], 404)]))   # 404: never stored
    assert cache.match(keys) == 3 and cache.unlinked == 1 and len(cache) == 3
    assert cache.match(block_keys([0] + PROMPT, BS)) == 0              # shifted: no block
    cache.apply(KVEventBatch(0.0, [BlockRemoved([12], "GPU")]))
    assert cache.match(keys) == 1                                      # the chain breaks at 2
    cache.apply(KVEventBatch(0.0, [AllBlocksCleared()]))
    assert cache.match(keys) == 0 and len(cache) == 0


def test_requests_just_sent_count_until_their_events_come():
    now = [0.0]
    cache = ReplicaCache(pending_ttl=5.0, block_size=BS, clock=lambda: now[0])
    keys = block_keys(PROMPT, BS)
    cache.sent(keys)
    assert cache.match(keys) == 5
    now[0] = 6.0
    assert cache.match(keys) == 0                                       # expired


class FakeReplica:
    """Answers completions with its name; holds them while `hold` is set (load)."""

    def __init__(self, name: str, run_dir: str):
        self.name = name
        self.events_at = f"ipc://{run_dir}/{name}-kv"
        self.replay_at = f"ipc://{run_dir}/{name}-replay"
        self.publisher = KvEventPublisher(self.events_at, self.replay_at, topic="kv")
        self.hold: asyncio.Event | None = None
        app = web.Application()
        app.router.add_routes([web.post("/v1/completions", self.complete),
                               web.post("/tokenize", self.tokenize),
                               web.get("/health", self.health)])
        self.server = TestServer(app)

    async def complete(self, request: web.Request) -> web.Response:
        if self.hold is not None:
            await self.hold.wait()
        return web.json_response({"replica": self.name})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": TEXT_TOKENS[body["prompt"]]})


async def _placed(client: TestClient, prompt, **extra) -> str:
    r = await client.post("/v1/completions", json={"prompt": prompt, **extra})
    assert r.status == 200
    return (await r.json())["replica"]


async def _until(check, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def _args(replicas: list[FakeReplica], policy: str = "kv-aware") -> argparse.Namespace:
    return argparse.Namespace(
        replicas=[str(r.server.make_url("")) for r in replicas], policy=policy,
        kv_events=[r.events_at for r in replicas],
        kv_events_replay=[r.replay_at for r in replicas], kv_events_topic="kv",
        min_match_blocks=1, balance_abs_threshold=1, balance_rel_threshold=1.5, block_size=16,
        prefill=None, decode=None)


def test_kv_aware_places_requests_where_their_prefix_is(tmp_path_factory):
    run_dir = make_run_dir(str(tmp_path_factory.mktemp("r")))

    async def main():
        a, b = FakeReplica("a", run_dir), FakeReplica("b", run_dir)
        try:
            for r in (a, b):
                await r.server.start_server()
                r.publisher.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
            # b's first batch goes out before the router listens: its replay fills it in.
            b.publisher.publish(KVEventBatch(0.0, [stored([1, 2], PROMPT[:8])]))
            async with TestClient(TestServer(make_app(_args([a, b])))) as client:
                async def state():
                    return (await (await client.get("/router/state")).json())["replicas"]

                async def b_knows(n):
                    async def check():
                        b.publisher.publish(KVEventBatch(0.0, []))   # until the SUB is joined
                        await asyncio.sleep(0.01)
                        return (await state())[1]["cached_blocks"] == n
                    return check
                b.publisher.publish(KVEventBatch(0.0, [stored([3], PROMPT[8:12], 2)]))
                await _until(await b_knows(3))
                assert (await state())[1]["block_size"] == BS
                assert await _placed(client, PROMPT + [1, 2, 3]) == "b"
                assert await _placed(client, "the shared document") == "b"      # /tokenize
                assert await _placed(client, [PROMPT] * 2) == "b"                 # a batch
                # a salted request's blocks are its own: by load, ties in turn
                assert {await _placed(client, PROMPT, cache_salt="s") for _ in range(2)} \
                    == {"a", "b"}
                # b loaded past the thresholds (2 in flight vs 0): the prefix is not worth it
                b.hold = asyncio.Event()
                held = [asyncio.create_task(_placed(client, PROMPT)) for _ in range(2)]
                await _until(lambda: _in_flight(state, 1, 2))
                assert await _placed(client, PROMPT) == "a"
                b.hold.set()
                assert await asyncio.gather(*held) == ["b", "b"]
                # b's scheduler restarted: numbers from 0 again, a fresh pool (the replay
                # gives the batches the router missed, AllBlocksCleared first)
                b.publisher.close()
                b.publisher = KvEventPublisher(b.events_at, b.replay_at, topic="kv")
                b.publisher.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
                b.publisher.publish(KVEventBatch(0.0, [stored([7], PROMPT[:4])]))
                await _until(await b_knows(1))
                seen = await (await client.get("/router/state")).json()
                assert seen["placed"] == {"prefix": 5, "load": 3, "round-robin": 0}
                assert [r["event_gaps"] for r in seen["replicas"]] == [0, 0]
        finally:
            for r in (a, b):
                r.publisher.close()
                await r.server.close()

    asyncio.run(main())


async def _in_flight(state, index: int, n: int) -> bool:
    return (await state())[index]["in_flight"] == n


def test_round_robin_takes_replicas_in_turn(tmp_path_factory):
    run_dir = make_run_dir(str(tmp_path_factory.mktemp("r")))

    async def main():
        a, b = FakeReplica("a", run_dir), FakeReplica("b", run_dir)
        try:
            for r in (a, b):
                await r.server.start_server()
            async with TestClient(TestServer(make_app(_args([a, b], "round-robin")))) as client:
                assert [await _placed(client, PROMPT) for _ in range(4)] == ["a", "b", "a", "b"]
        finally:
            for r in (a, b):
                r.publisher.close()
                await r.server.close()

    asyncio.run(main())
