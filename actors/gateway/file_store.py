"""/v1/files' storage: each file on disk under --files-dir as <id> beside <id>.json (its
metadata, OpenAI's file object plus its owner), bounded by --files-max-bytes in all; a file
belongs to the API key that made it (another key does not find it). Batch inputs are uploaded
here, and a batch's output and error files are written here."""
from __future__ import annotations

import json
import os
import time
import uuid

from .protocol import ApiError

PURPOSES = ("batch", "batch_output")


class FileStore:
    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        os.makedirs(directory, exist_ok=True)

    def _path(self, file_id: str) -> str:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise ApiError(404, f"file {file_id!r} not found", "file_id")
        return os.path.join(self.directory, file_id)

    def used(self) -> int:
        return sum(entry["bytes"] for entry in self._entries())

    def save(self, owner: str | None, data: bytes, filename: str, purpose: str) -> dict:
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose must be batch, not {purpose!r}", "purpose")
        if self.used() + len(data) > self.max_bytes:
            raise ApiError(413, f"the files would pass --files-max-bytes ({self.max_bytes})")
        entry = {"id": f"file-{uuid.uuid4().hex}", "object": "file", "bytes": len(data),
                 "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                 "status": "processed", "owner": owner}
        path = self._path(entry["id"])
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        with open(path + ".json", "w") as f:
            json.dump(entry, f)
        return _public(entry)

    def get(self, owner: str | None, file_id: str) -> dict:
        try:
            with open(self._path(file_id) + ".json") as f:
                entry = json.load(f)
        except OSError:
            raise ApiError(404, f"file {file_id!r} not found", "file_id") from None
        if entry.get("owner") != owner:
            raise ApiError(404, f"file {file_id!r} not found", "file_id")
        return _public(entry)

    def content(self, owner: str | None, file_id: str) -> bytes:
        self.get(owner, file_id)
        with open(self._path(file_id), "rb") as f:
            return f.read()

    def delete(self, owner: str | None, file_id: str) -> dict:
        self.get(owner, file_id)
        path = self._path(file_id)
        for name in (path, path + ".json"):
            if os.path.exists(name):
                os.remove(name)
        return {"id": file_id, "object": "file", "deleted": True}

    def list(self, owner: str | None) -> list[dict]:
        return sorted((_public(e) for e in self._entries() if e.get("owner") == owner),
                      key=lambda e: e["created_at"], reverse=True)

    def _entries(self) -> list[dict]:
        out = []
        for name in os.listdir(self.directory):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(self.directory, name)) as f:
                        out.append(json.load(f))
                except (OSError, ValueError):
                    continue
        return out


def _public(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "owner"}
