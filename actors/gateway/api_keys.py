"""The gateway's API keys (--api-key): which paths they guard, the key a request presents, and
the cache salt of its tenant (--cache-salt-per-api-key). With no key configured every route is
open and a request's own cache_salt stands."""
from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from .protocol import ApiError
from .sleep_routes import PATHS as SLEEP_PATHS

# What the API keys guard (/api/: Ollama's routes, ollama_routes.py; the pooling routes
# outside /v1/, pooling_routes.py); /metrics optionally.
KEYED_PATHS = ("/v1/", "/v2/", "/api/", "/tokenize", "/detokenize", "/admin/", "/pooling",
               "/score", "/rerank", "/classify", *SLEEP_PATHS)


class ApiKeys:
    def __init__(self, server):
        """server: the ServerConfig section."""
        self.server = server

    def guards(self, path: str) -> bool:
        """Whether a request to `path` must present a key (when keys are configured)."""
        return path.startswith(KEYED_PATHS) or (
            path == "/metrics" and self.server.metrics_require_api_key)

    def check(self, request: web.Request) -> str | None:
        """The request's bearer key, checked against every configured key in constant time.
        Raises 401 when keys are configured and none matches."""
        if not self.server.api_keys:
            return None
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else \
            request.headers.get("x-api-key", "").strip()      # Anthropic's clients send this
        matched = None
        for key in self.server.api_keys:     # no early exit: timing does not tell which key
            if hmac.compare_digest(given.encode(), key.encode()):
                matched = key
        if matched is None:
            raise ApiError(401, "invalid or missing API key", error_type="AuthenticationError")
        return matched

    def salt(self, request: web.Request, body) -> str | None:
        """The request's cache salt. With cache_salt_per_api_key, each API key gets its own
        salt (derived from the key, never the key itself) so tenants never share KV blocks,
        whatever salt a client sends."""
        key = self.check(request) if self.server.cache_salt_per_api_key else None
        if key is None:
            return body.cache_salt
        tenant = hashlib.sha256(b"pagewire-tenant\0" + key.encode()).hexdigest()[:32]
        return f"{tenant}:{body.cache_salt or ''}"
