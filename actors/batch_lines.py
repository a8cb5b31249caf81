"""OpenAI's batch file format, run against a serving gateway: each input line a request
({"custom_id", "method": "POST", "url", "body"}), each output line its answer ({"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}). Every line is
sent to the gateway's own route over HTTP, so a batch's answer is byte for byte what a client
of that route gets: one request path. Used by `pagewire run-batch` (a gateway it starts) and
by the gateway's /v1/batches (its own routes, at a lower priority). No torch here.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Callable

import aiohttp

# what a line may ask (OpenAI's batch endpoints, and vLLM's run-batch's /v1/score, /v1/rerank)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score",
             "/v1/rerank")
BATCH_PRIORITY = 1000          # a batch line's `priority` (lower first under --scheduling-policy
                               # priority); interactive requests default to 0


class BatchFileError(ValueError):
    """The input file as a whole cannot run (a duplicated custom_id, no line)."""


def read_requests(text: str) -> list[dict]:
    """The input lines, each as given or as an error to answer: {"line": parsed dict} or
    {"custom_id": ..., "error": message}. Raises BatchFileError for duplicated custom_ids
    (a resume tells lines apart by them) or an empty file."""
    out, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as e:
            out.append({"custom_id": f"line-{number}", "error": f"line {number}: {e}"})
            continue
        if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str):
            out.append({"custom_id": f"line-{number}",
                        "error": f"line {number}: a request needs a string custom_id"})
            continue
        if line["custom_id"] in seen:
            raise BatchFileError(f"line {number}: custom_id {line['custom_id']!r} is repeated")
        seen.add(line["custom_id"])
        out.append({"custom_id": line["custom_id"], "line": line})
    if not out:
        raise BatchFileError("the batch file holds no request")
    return out


def done_ids(text: str) -> tuple[set[str], str]:
    """The custom_ids an output file already answers, and its text without a torn last line
    (a kill mid-write): what a resume keeps."""
    ids, kept = set(), []
    for raw in text.splitlines(keepends=True):
        try:
            if not raw.endswith("\n"):
                break                              # torn: this line is redone
            ids.add(json.loads(raw)["custom_id"])
        except (ValueError, KeyError, TypeError):
            break
        kept.append(raw)
    return ids, "".join(kept)


def _error_line(custom_id: str, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


async def answer(session: aiohttp.ClientSession, base_url: str, request: dict,
                 headers: dict, endpoint: str | None = None) -> dict:
    """One input entry (read_requests') -> its output line. `endpoint`: the only url the
    batch may name (a /v1/batches job's), or None for any of ENDPOINTS."""
    if "error" in request:
        return _error_line(request["custom_id"], "invalid_request", request["error"])
    line, custom_id = request["line"], request["custom_id"]
    url, body = line.get("url"), line.get("body")
    allowed = (endpoint,) if endpoint else ENDPOINTS
    if line.get("method", "POST") != "POST" or url not in allowed:
        return _error_line(custom_id, "invalid_url",
                           f"method POST and url {' or '.join(allowed)} only")
    if not isinstance(body, dict):
        return _error_line(custom_id, "invalid_request", "body must be a JSON object")
    body = {**body, "stream": False}
    body.setdefault("priority", BATCH_PRIORITY)
    try:
        async with session.post(base_url + url, json=body, headers=headers) as response:
            answer_body = await response.json(content_type=None)
            request_id = response.headers.get("X-Request-Id") or answer_body.get("id", "")
            return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                    "response": {"status_code": response.status, "request_id": request_id,
                                 "body": answer_body}, "error": None}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return _error_line(custom_id, "server_error", f"{type(e).__name__}: {e}")


async def run_requests(base_url: str, requests: list[dict], write: Callable[[dict], None],
                       concurrency: int, headers: dict | None = None,
                       endpoint: str | None = None,
                       progress: Callable[[], None] | None = None) -> None:
    """Answer every request, at most `concurrency` in flight (the engine batches them
    continuously), calling write(output line) as each finishes."""
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(request: dict) -> None:
            async with gate:
                write(await answer(session, base_url, request, headers or {}, endpoint))
            if progress is not None:
                progress()
        await asyncio.gather(*(one(r) for r in requests))
