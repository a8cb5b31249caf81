"""/v1/files and /v1/batches: OpenAI's batch API in the gateway. A batch reads an uploaded
file of requests (batch_lines.py's format), sends each to this gateway's own route with the
batch's key, at BATCH_PRIORITY and at most --batch-concurrency in flight (interactive requests
keep their room), and writes the answers to an output file and the failed lines to an error
file (file_store.py). Batches are kept in the gateway's memory (a restart forgets them; their
files stay); each is its API key's alone."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import uuid

import msgspec
from aiohttp import web

from ..batch_lines import ENDPOINTS, BatchFileError, read_requests, run_requests
from ..model_info import cache_root
from .file_store import FileStore
from .protocol import ApiError, decode_body

WINDOWS = ("24h",)


class BatchBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class BatchJob:
    """One batch: OpenAI's batch object, and the task running it."""

    def __init__(self, owner: str | None, body: BatchBody, key: str | None):
        self.owner, self.key, self.task = owner, key, None
        self.obj = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch",
                    "endpoint": body.endpoint, "errors": None,
                    "input_file_id": body.input_file_id,
                    "completion_window": body.completion_window, "status": "validating",
                    "output_file_id": None, "error_file_id": None,
                    "created_at": int(time.time()), "in_progress_at": None,
                    "completed_at": None, "cancelling_at": None, "cancelled_at": None,
                    "failed_at": None, "request_counts": {"total": 0, "completed": 0,
                                                          "failed": 0},
                    "metadata": body.metadata}

    def set(self, status: str) -> None:
        self.obj["status"] = status
        self.obj[f"{status}_at"] = int(time.time())


class BatchRoutes:
    def __init__(self, gateway):
        self.gw = gateway
        server = gateway.config.server
        self.files = FileStore(server.files_dir or os.path.join(cache_root(), "files"),
                               server.files_max_bytes)
        self.concurrency = server.batch_concurrency
        self.jobs: dict[str, BatchJob] = {}

    def routes(self) -> list:
        return [web.post("/v1/files", self.upload), web.get("/v1/files", self.list_files),
                web.get("/v1/files/{id}", self.file), web.delete("/v1/files/{id}", self.delete),
                web.get("/v1/files/{id}/content", self.content),
                web.post("/v1/batches", self.create), web.get("/v1/batches", self.list_batches),
                web.get("/v1/batches/{id}", self.batch),
                web.post("/v1/batches/{id}/cancel", self.cancel)]

    def owner(self, request: web.Request) -> str | None:
        """The caller's API key as an owner tag (a digest: no key is written to disk)."""
        key = self.gw.keys.check(request)
        return hashlib.sha256(b"pagewire-owner\0" + key.encode()).hexdigest()[:32] \
            if key else None

    # -- files ---------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        owner = self.owner(request)
        try:
            reader = await request.multipart()
        except (AssertionError, ValueError):
            raise ApiError(400, "upload a multipart form: file and purpose", "file") from None
        purpose, name, data = None, None, None
        async for part in reader:
            if part.name == "purpose":
                purpose = (await part.read()).decode(errors="replace")
            elif part.name == "file":
                name, data = part.filename or "upload.jsonl", await self._capped(part)
        if data is None or purpose is None:
            raise ApiError(400, "a file upload needs the fields file and purpose", "file")
        return web.json_response(self.files.save(owner, data, name, purpose))

    async def _capped(self, part) -> bytes:
        """A file part's bytes, refused (413) as soon as they pass --files-max-bytes: an
        upload is never held whole beyond the bound."""
        data = bytearray()
        while chunk := await part.read_chunk(1 << 16):
            data += chunk
            if len(data) > self.files.max_bytes:
                raise ApiError(413, f"the file is over --files-max-bytes "
                                    f"({self.files.max_bytes})")
        return bytes(data)

    async def list_files(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.files.list(self.owner(request)),
                                  "has_more": False})

    async def file(self, request: web.Request) -> web.Response:
        return web.json_response(self.files.get(self.owner(request), request.match_info["id"]))

    async def delete(self, request: web.Request) -> web.Response:
        return web.json_response(self.files.delete(self.owner(request),
                                                   request.match_info["id"]))

    async def content(self, request: web.Request) -> web.Response:
        data = self.files.content(self.owner(request), request.match_info["id"])
        return web.Response(body=data, content_type="application/jsonl")

    # -- batches -------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), BatchBody)
        owner = self.owner(request)
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {body.endpoint!r}: one of {', '.join(ENDPOINTS)}",
                           "endpoint")
        if body.completion_window not in WINDOWS:
            raise ApiError(400, "completion_window must be 24h", "completion_window")
        self.files.get(owner, body.input_file_id)          # a 404 before the work below
        try:       # reading and parsing a large file off the event loop: other requests stream
            requests = await asyncio.to_thread(
                lambda: read_requests(self.files.content(owner, body.input_file_id).decode(
                    errors="replace")))
        except BatchFileError as e:
            raise ApiError(400, f"input file: {e}", "input_file_id") from None
        job = BatchJob(owner, body, self.gw.keys.check(request))
        job.obj["request_counts"]["total"] = len(requests)
        self.jobs[job.obj["id"]] = job
        job.task = asyncio.create_task(self._run(job, requests))
        return web.json_response(job.obj)

    async def _run(self, job: BatchJob, requests: list[dict]) -> None:
        job.set("in_progress")
        answers, errors = [], []
        counts = job.obj["request_counts"]

        def write(line: dict) -> None:
            ok = line["error"] is None and line["response"]["status_code"] == 200
            (answers if ok else errors).append(line)
            counts["completed" if ok else "failed"] += 1
        headers = {"Authorization": f"Bearer {job.key}"} if job.key else {}
        try:
            await run_requests(self.gw.own_url(), requests, write, self.concurrency, headers,
                               job.obj["endpoint"])
        except asyncio.CancelledError:
            self._keep(job, answers, errors)
            job.set("cancelled")
            raise
        self._keep(job, answers, errors)
        job.set("completed")

    def _keep(self, job: BatchJob, answers: list[dict], errors: list[dict]) -> None:
        for lines, field in ((answers, "output_file_id"), (errors, "error_file_id")):
            if lines:
                data = "".join(json.dumps(line) + "\n" for line in lines).encode()
                job.obj[field] = self.files.save(job.owner, data, f"{job.obj['id']}_{field}"
                                                 ".jsonl", "batch_output")["id"]

    def _job(self, request: web.Request) -> BatchJob:
        job = self.jobs.get(request.match_info["id"])
        if job is None or job.owner != self.owner(request):
            raise ApiError(404, f"batch {request.match_info['id']!r} not found", "batch_id")
        return job

    async def batch(self, request: web.Request) -> web.Response:
        return web.json_response(self._job(request).obj)

    async def list_batches(self, request: web.Request) -> web.Response:
        owner = self.owner(request)
        data = [j.obj for j in reversed(self.jobs.values()) if j.owner == owner]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def cancel(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if job.task is not None and not job.task.done():
            job.set("cancelling")
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        return web.json_response(job.obj)
