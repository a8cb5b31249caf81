"""The bytes of a request's images, fetched at the edge (I/O the gateway's event loop does
while other requests stream; decoding and preprocessing are the tokenizer's): `data:` URLs
decoded, `file://` paths read only under --allowed-local-media-path, `http(s)://` URLs
fetched only from --allowed-media-domains, with a timeout; each image at most
MAX_IMAGE_BYTES, and a prompt at most --limit-mm-per-prompt images. Refusals are 400s naming
`messages`."""
from __future__ import annotations

import asyncio
import base64
import binascii
import os
from urllib.parse import unquote, urlparse

import aiohttp

from .protocol import ApiError

MAX_IMAGE_BYTES = 20 * 2**20
FETCH_TIMEOUT_S = 10.0
DEFAULT_IMAGES_PER_PROMPT = 8


def _refuse(message: str) -> ApiError:
    return ApiError(400, message, "messages")


class MediaFetcher:
    """The server's media options, and the fetches they allow."""

    def __init__(self, server_config):
        self.limit = int(server_config.limit_mm_per_prompt.get("image",
                                                               DEFAULT_IMAGES_PER_PROMPT))
        root = server_config.allowed_local_media_path
        self.root = os.path.realpath(root) if root else None
        self.domains = {d.lower() for d in server_config.allowed_media_domains}

    async def fetch_all(self, urls: list[str]) -> list[bytes]:
        if len(urls) > self.limit:
            raise _refuse(f"{len(urls)} images in one prompt; the limit is {self.limit} "
                          f"(--limit-mm-per-prompt)")
        return list(await asyncio.gather(*(self.fetch(url, i) for i, url in enumerate(urls))))

    async def fetch(self, url: str, index: int) -> bytes:
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return _data_url(url, index)
        if scheme == "file":
            return self._local(url, index)
        if scheme in ("http", "https"):
            return await self._remote(url, index)
        raise _refuse(f"image {index}: URL scheme {scheme!r} is not supported "
                      f"(data:, file://, http(s)://)")

    def _local(self, url: str, index: int) -> bytes:
        if self.root is None:
            raise _refuse(f"image {index}: file:// URLs need --allowed-local-media-path")
        path = os.path.realpath(unquote(urlparse(url).path))
        if os.path.commonpath([path, self.root]) != self.root:
            raise _refuse(f"image {index}: {path} is outside the allowed media path")
        try:
            if os.path.getsize(path) > MAX_IMAGE_BYTES:
                raise _refuse(f"image {index}: over {MAX_IMAGE_BYTES} bytes")
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise _refuse(f"image {index}: cannot read {path}: {e.strerror}") from None

    async def _remote(self, url: str, index: int) -> bytes:
        host = (urlparse(url).hostname or "").lower()
        if host not in self.domains:
            raise _refuse(f"image {index}: host {host!r} is not in --allowed-media-domains")
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url, allow_redirects=False) as response:
                    if response.status != 200:
                        raise _refuse(f"image {index}: {url} answered {response.status}")
                    data = await response.content.read(MAX_IMAGE_BYTES + 1)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _refuse(f"image {index}: fetching {url} failed: {type(e).__name__}") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise _refuse(f"image {index}: over {MAX_IMAGE_BYTES} bytes")
        return data


def _data_url(url: str, index: int) -> bytes:
    """data:[<mediatype>][;base64],<data>"""
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _refuse(f"image {index}: a data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise _refuse(f"image {index}: over {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(f"image {index}: the data: URL is not valid base64") from None
