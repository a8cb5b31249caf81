"""`pagewire router`: an OpenAI endpoint in front of pagewire engines, in one of two modes.

    pagewire router --replicas http://10.0.0.5:8000 http://10.0.0.6:8000 --policy kv-aware \
        [--kv-events tcp://10.0.0.5:5557 tcp://10.0.0.6:5557] [--kv-events-replay ...]
    pagewire router --prefill http://10.0.0.5:8100 --decode http://10.0.0.6:8200 [--port 8000]

Replicas of one model (router_replicas.py): each request placed on one replica, by the
prefix its replica has cached (kv-aware, from the replicas' KV events) or in turn
(round-robin); docs/router.md.

Disaggregated prefill and decode, vLLM's proxy flow (wire/kv_transfer.py): each completion or
chat request goes first to a prefill engine (round robin) with max_tokens 1, not streamed,
and `kv_transfer_params: {"do_remote_decode": true}`; its answer's `kv_transfer_params` are
added to the original request, which goes to a decode engine (round robin) and is answered
from there, streamed or not, as it comes. A prefill engine that answers with an error ends
the request with that answer; one that cannot be reached sends the request to a decode
engine without transfer parameters (it computes the prompt itself); a decode engine that
cannot be reached (nothing sent yet) passes the request to the next. /v1/models and /metrics
are the first decode engine's; /health is 200 when every engine answers its own. aiohttp
only, no torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging

import aiohttp
from aiohttp import web

from .router_http import ROUTES, down_engines, error, json_body, passed_headers, relay
from .router_replicas import POLICIES, Placement, ReplicaRouter

log = logging.getLogger("router")


def add_command(sub) -> None:
    p = sub.add_parser("router", help="an OpenAI endpoint in front of engine replicas "
                                      "(kv-aware or round-robin) or of prefill and decode "
                                      "engines (disaggregated prefill/decode)")
    p.add_argument("--replicas", nargs="+", metavar="URL", help="replicas of one model")
    p.add_argument("--policy", choices=POLICIES, default="kv-aware",
                   help="how --replicas are chosen (default kv-aware)")
    p.add_argument("--kv-events", nargs="+", default=[], metavar="ENDPOINT",
                   help="each replica's KV event endpoint (its --kv-events-config endpoint), "
                        "in --replicas order")
    p.add_argument("--kv-events-replay", nargs="+", default=[], metavar="ENDPOINT",
                   help="each replica's replay endpoint, in --replicas order")
    p.add_argument("--kv-events-topic", default="", help="the replicas' topic")
    p.add_argument("--min-match-blocks", type=int, default=1,
                   help="cached blocks a replica needs to be chosen for them")
    p.add_argument("--balance-abs-threshold", type=int, default=4,
                   help="requests in flight the best replica may have over the least loaded")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and times as many (beyond both: the least loaded is chosen)")
    p.add_argument("--block-size", type=int, default=16,
                   help="the replicas' block size until their events say it")
    p.add_argument("--prefill", nargs="+", metavar="URL",
                   help="prefill engines (started with kv_role kv_producer)")
    p.add_argument("--decode", nargs="+", metavar="URL",
                   help="decode engines (kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


class Router:
    def __init__(self, prefill: list[str], decode: list[str]):
        self.prefill, self.decode = prefill, decode
        self.next_prefill, self.next_decode = itertools.cycle(prefill), itertools.cycle(decode)
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_routes([web.post(r, self.generate) for r in ROUTES] +
                              [web.get("/v1/models", self.passthrough),
                               web.get("/metrics", self.passthrough),
                               web.get("/health", self.health)])
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def _close(self, _app) -> None:
        await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        headers = passed_headers(request)
        prefilled = await self._prefill(request.path, body, headers)
        if isinstance(prefilled, web.Response):
            return prefilled
        if prefilled:
            body = {**body, "kv_transfer_params": prefilled}
        for _ in range(len(self.decode)):     # one not reached: the request has not started
            url = f"{next(self.next_decode)}{request.path}"
            try:
                return await relay(self.session, request, url, body, headers)
            except aiohttp.ClientConnectorError as e:
                log.warning("decode engine %s unreachable (%s); trying the next", url, e)
        return error(502, "no decode engine could be reached")

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | web.Response | None:
        """The prefill engine's transfer parameters; its error answer; or None if it cannot
        be reached (the decode engine then computes the prompt)."""
        asked = {**body, "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}
        for key in ("max_completion_tokens", "min_tokens", "stream_options"):
            asked.pop(key, None)
        if "max_completion_tokens" in body:
            asked["max_completion_tokens"] = 1
        url = f"{next(self.next_prefill)}{path}"
        try:
            async with self.session.post(url, json=asked, headers=headers) as r:
                answer = await r.read()
                if r.status != 200:
                    return web.Response(body=answer, status=r.status,
                                        content_type="application/json")
                return json.loads(answer).get("kv_transfer_params")
        except aiohttp.ClientError as e:
            log.warning("prefill engine %s unreachable (%s); the decode engine computes it",
                        url, e)
            return None

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        try:
            return await relay(self.session, request, f"{self.decode[0]}{request.path}", None,
                               passed_headers(request), method="GET")
        except aiohttp.ClientConnectorError as e:
            return error(502, f"decode engine unreachable: {e}")

    async def health(self, request: web.Request) -> web.Response:
        down = await down_engines(self.session, self.prefill + self.decode)
        return web.json_response({"down": down}, status=503 if down else 200)


def _strip(urls: list[str] | None) -> list[str]:
    return [u.rstrip("/") for u in urls or []]


def make_app(args: argparse.Namespace) -> web.Application:
    """The router's application for the parsed flags; ValueError if they do not fit."""
    if args.replicas:
        if args.prefill or args.decode:
            raise ValueError("give --replicas, or --prefill and --decode, not both")
        for flag, given in (("--kv-events", args.kv_events),
                            ("--kv-events-replay", args.kv_events_replay)):
            if given and len(given) != len(args.replicas):
                raise ValueError(f"{flag} takes one endpoint per replica "
                                 f"({len(args.replicas)}), got {len(given)}")
        placement = Placement(args.policy, args.min_match_blocks, args.balance_abs_threshold,
                              args.balance_rel_threshold)
        return ReplicaRouter(_strip(args.replicas), placement, args.kv_events,
                             args.kv_events_replay, args.kv_events_topic,
                             block_size=args.block_size).app()
    if not (args.prefill and args.decode):
        raise ValueError("give --replicas, or both --prefill and --decode")
    return Router(_strip(args.prefill), _strip(args.decode)).app()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s router %(levelname)s %(message)s")
    try:
        app = make_app(args)
    except ValueError as e:
        print(f"pagewire router: {e}")
        return 2
    web.run_app(app, host=getattr(args, "host", "127.0.0.1"),
                port=getattr(args, "port", 8000), print=None)
    return 0
