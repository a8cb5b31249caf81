"""`pagewire router --replicas URL ... --policy kv-aware|round-robin`: one OpenAI endpoint in
front of replicas of one model, each completion or chat request placed on one replica.

- round-robin: each replica in turn.
- kv-aware: the replica holding the longest cached prefix of the request's blocks
  (router_kv_index.py, from the replica's KV events, router_kv_events.py), ties going to the
  one with fewer requests in flight; the least loaded replica when no replica holds
  `--min-match-blocks` of them, when the request carries a cache_salt (its blocks are its
  own), or when the best replica's load has drifted from the least loaded one's by more than
  `--balance-abs-threshold` requests and `--balance-rel-threshold` times.
  The request's token ids: a completion prompt given as ids is used as it is; a text prompt
  or chat messages are sent to the least loaded replica's /tokenize first (vLLM's and
  pagewire's route), which applies the same template and special tokens as the request will.

A replica that cannot be reached (nothing sent yet) passes the request to the next best.
/v1/models and /metrics are the first replica's; /health is 200 when every replica answers
its own; /router/state shows each replica's load and cached blocks. aiohttp only, no torch.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import aiohttp
import zmq.asyncio
from aiohttp import web

from .router_http import ROUTES, down_engines, error, json_body, passed_headers, relay
from .router_kv_events import ReplicaEvents
from .router_kv_index import ReplicaCache, block_keys

log = logging.getLogger("router")
POLICIES = ("kv-aware", "round-robin")


@dataclass
class Replica:
    url: str
    cache: ReplicaCache = field(default_factory=ReplicaCache)
    in_flight: int = 0
    served: int = 0
    events: ReplicaEvents | None = None


@dataclass(frozen=True)
class Placement:
    """How requests are placed (the CLI's --policy and thresholds)."""
    policy: str = "kv-aware"
    min_match_blocks: int = 1
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5


class ReplicaRouter:
    def __init__(self, urls: list[str], placement: Placement,
                 kv_events: list[str] | None = None, replay: list[str] | None = None,
                 topic: str = "", pending_ttl: float = 30.0, block_size: int = 16):
        self.replicas = [Replica(u, ReplicaCache(pending_ttl, block_size)) for u in urls]
        self.placement = placement
        self.kv_events, self.replay, self.topic = kv_events or [], replay or [], topic
        self.turn = itertools.cycle(range(len(urls)))
        self.session: aiohttp.ClientSession | None = None
        self.ctx: zmq.asyncio.Context | None = None
        self.tasks: list[asyncio.Task] = []
        self.placed = {"prefix": 0, "load": 0, "round-robin": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_routes([web.post(r, self.generate) for r in ROUTES] +
                              [web.get("/v1/models", self.passthrough),
                               web.get("/metrics", self.passthrough),
                               web.get("/health", self.health),
                               web.get("/router/state", self.state)])
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        if self.kv_events:
            self.ctx = zmq.asyncio.Context()
            for i, (replica, endpoint) in enumerate(zip(self.replicas, self.kv_events)):
                replay = self.replay[i] if i < len(self.replay) else None
                replica.events = ReplicaEvents(self.ctx, endpoint, replay, self.topic,
                                               replica.cache)
                self.tasks.append(asyncio.create_task(replica.events.run()))

    async def _close(self, _app) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for replica in self.replicas:
            if replica.events is not None:
                replica.events.close()
        if self.ctx is not None:
            self.ctx.term()
        await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        headers = passed_headers(request)
        order, keys = await self.order(request.path, body, headers)
        for replica in order:         # one not reached: the request has not started
            replica.in_flight += 1
            if replica.cache.block_size in keys:
                replica.cache.sent(keys[replica.cache.block_size])
            try:
                response = await relay(self.session, request, f"{replica.url}{request.path}",
                                       body, headers)
                replica.served += 1
                return response
            except aiohttp.ClientConnectorError as e:
                log.warning("replica %s unreachable (%s); trying the next", replica.url, e)
            finally:
                replica.in_flight -= 1
        return error(502, "no replica could be reached")

    async def order(self, path: str, body: dict, headers: dict
                    ) -> tuple[list[Replica], dict[int | None, list[int]]]:
        """The replicas to try, best first, and the request's block keys by block size."""
        n = len(self.replicas)
        if self.placement.policy == "round-robin":
            first = next(self.turn)
            self.placed["round-robin"] += 1
            return [self.replicas[(first + i) % n] for i in range(n)], {}
        by_load = sorted(self.replicas, key=lambda r: r.in_flight)
        tokens = None if body.get("cache_salt") else \
            await self.token_ids(path, body, headers, by_load[0])
        sizes = {r.cache.block_size for r in self.replicas if r.cache.block_size}
        keys = {s: block_keys(tokens, s) for s in sizes} if tokens else {}
        matches = {id(r): r.cache.match(keys[r.cache.block_size])
                   if r.cache.block_size in keys else 0 for r in self.replicas}
        best = max(self.replicas, key=lambda r: (matches[id(r)], -r.in_flight))
        if matches[id(best)] >= self.placement.min_match_blocks \
                and not self.drifted(best, by_load[0]):
            self.placed["prefix"] += 1
            return [best] + [r for r in by_load if r is not best], keys
        self.placed["load"] += 1
        return self.least_loaded_first(by_load), keys

    def drifted(self, best: Replica, least: Replica) -> bool:
        p = self.placement
        return best.in_flight - least.in_flight > p.balance_abs_threshold and \
            best.in_flight > p.balance_rel_threshold * least.in_flight

    def least_loaded_first(self, by_load: list[Replica]) -> list[Replica]:
        """Ties are taken in turn (an idle cluster spreads its first requests)."""
        low = [r for r in by_load if r.in_flight == by_load[0].in_flight]
        start = next(self.turn) % len(low)
        return low[start:] + low[:start] + by_load[len(low):]

    async def token_ids(self, path: str, body: dict, headers: dict,
                        replica: Replica) -> list[int] | None:
        """The prompt's token ids as the replicas will see them; None if unknown."""
        if path.endswith("/chat/completions"):
            asked = {"messages": body.get("messages"), "add_generation_prompt": True}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]                   # a batch: placed by its first prompt
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None
            asked = {"prompt": prompt}
        if "model" in body:
            asked["model"] = body["model"]
        try:
            async with self.session.post(f"{replica.url}/tokenize", json=asked,
                                         headers=headers) as r:
                if r.status != 200:
                    return None
                return (await r.json()).get("tokens")
        except (aiohttp.ClientError, ValueError):
            return None

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        try:
            return await relay(self.session, request, f"{self.replicas[0].url}{request.path}",
                               None, passed_headers(request), method="GET")
        except aiohttp.ClientConnectorError as e:
            return error(502, f"replica unreachable: {e}")

    async def health(self, request: web.Request) -> web.Response:
        down = await down_engines(self.session, [r.url for r in self.replicas])
        return web.json_response({"down": down}, status=503 if down else 200)

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response({"policy": self.placement.policy, "placed": self.placed,
                                  "replicas": [_replica_state(r) for r in self.replicas]})


def _replica_state(r: Replica) -> dict:
    events = r.events
    return {"url": r.url, "in_flight": r.in_flight, "served": r.served,
            "cached_blocks": len(r.cache), "block_size": r.cache.block_size,
            "event_batches": events.batches if events else 0,
            "event_gaps": events.gaps if events else 0}
