"""Streaming input over HTTP: a completion whose prompt arrives in pieces (vLLM's streaming
input, as a session of HTTP calls).

    POST /v1/completions  {"request_id": "s1", "stream_input": true, "prompt": "first piece",
                           "stream": true, ...}          # answered once generation ends
    POST /v1/completions/s1/input  {"prompt": "more"}                       # 200 at once
    POST /v1/completions/s1/input  {"prompt": " and the end", "last": true}

The first call opens the session under the client's `request_id` and holds its response
(streamed or not) until the prompt is closed and generation ends; each piece is prefilled
as it arrives. Pieces are text (encoded on its own, without special tokens) or token ids.
Closing the first call's connection aborts the session and frees its blocks.

A session's messages all go to tokenizer 0 over one socket (tokenizer_pool.py send_pinned),
so the scheduler sees the request before its pieces and the pieces in order. The gateway keeps
no pieces: a session whose tokenizer dies before its first answer fails (503).
"""
from __future__ import annotations

import msgspec
from aiohttp import web

from pagewire.wire.to_tokenizer import TokenizePiece, TokenizeRequest

from .protocol import ApiError, decode_body


class PieceBody(msgspec.Struct, kw_only=True):
    prompt: str | list[int]
    last: bool = False


class StreamInputRoutes:
    def __init__(self, gateway, tokenizers):
        """tokenizers: the gateway's TokenizerPool."""
        self.gateway, self.tokenizers = gateway, tokenizers
        self.sessions: dict[str, str] = {}      # client request_id -> the engine's request id
        self.vocab_size = gateway.config.model.model_info.vocab_size

    def routes(self) -> list:
        return [web.post("/v1/completions/{request_id}/input", self.piece)]

    def check(self, body, prompts: list[dict]) -> str:
        """The session id of a completion with stream_input, or a 400 naming what is wrong."""
        if not body.request_id:
            raise ApiError(400, "stream_input needs a request_id (the session's name)",
                           "request_id")
        if len(prompts) != 1:
            raise ApiError(400, "stream_input takes one prompt", "prompt")
        if body.request_id in self.sessions:
            raise ApiError(400, f"session {body.request_id!r} is already open", "request_id")
        return body.request_id

    def open(self, session: str, sub: TokenizeRequest) -> None:
        """The session's first request (its id already assigned) goes out, its prompt open."""
        sub.prompt_open = True
        self.sessions[session] = sub.req_id
        self.tokenizers.send_pinned(sub)

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)

    async def piece(self, request: web.Request) -> web.Response:
        self.gateway.keys.check(request)
        session = request.match_info["request_id"]
        req_id = self.sessions.get(session)
        if req_id is None:
            raise ApiError(404, f"no open streamed prompt {session!r}", "request_id")
        body = decode_body(await request.read(), PieceBody)
        text = body.prompt if isinstance(body.prompt, str) else None
        ids = None if text is not None else body.prompt
        bad = [t for t in ids or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range [0, {self.vocab_size})",
                           "prompt")
        if body.last:
            self.close(session)         # no piece after the last
        self.tokenizers.send_pinned(TokenizePiece(req_id=req_id, reply_id=f"{req_id}:piece",
                                                  prompt=text, prompt_token_ids=ids,
                                                  last=body.last))
        return web.json_response({"request_id": session, "object": "prompt.piece",
                                  "last": body.last})
