"""Ollama's answers (doors.py): the OpenAI answers of a chat or completion turned into
/api/chat's {"message": ...} and /api/generate's {"response": ...} objects, streamed as
newline-delimited JSON, ending in one object with "done": true and Ollama's figures.

Ollama sends a tool call whole, its arguments an object; OpenAI streams a named call's
arguments in pieces, so calls are gathered and sent once the choice finishes. Durations are
nanoseconds: the prompt's part runs from the request's start (the door is made before the
prompt is sent) to its first token, queueing and tokenizing included; the rest is
generating; nothing is ever loaded (load_duration 0).
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from .doors import Door, chunk_choice, ndjson
from .protocol import ApiError
from .responses import Formatter

# OpenAI's finish reasons as Ollama's done_reason (a tool call is a stop there)
DONE_REASONS = {"tool_calls": "stop"}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI tool calls as Ollama's: arguments an object (text that is not JSON kept as it
    is, rather than lost)."""
    out = []
    for index, c in enumerate(calls):
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = c["function"]["arguments"]
        out.append({"id": c.get("id"), "function": {"index": index, "name": c["function"]["name"],
                                                    "arguments": args}})
    return out


def completion_logprobs(lp: dict) -> list[dict]:
    """A completion's parallel logprob lists as Ollama's list of entries."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return [dict(entry(t, lp_), top_logprobs=[entry(k, v) for k, v in (top or {}).items()])
            for t, lp_, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


class OllamaChat(Door):
    """/api/chat's answers."""

    name = "ollama"
    content_type = "application/x-ndjson"

    def __init__(self, fmt: Formatter, include_usage: bool = False):
        super().__init__(fmt, include_usage)
        self.began = self.first = time.monotonic_ns()
        self.reason: str | None = None
        self.calls: dict[int, dict] = {}         # streamed tool calls, gathered by index

    def part(self, content: str, thinking: str | None = None,
             calls: list[dict] | None = None) -> dict:
        """The answer's own field(s) of one object."""
        message = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def started(self, usage: dict) -> None:
        self.first = time.monotonic_ns()

    def obj(self, part: dict, done: bool = False) -> dict:
        return {"model": self.fmt.model, "created_at": now_iso(), **part, "done": done}

    def figures(self, usage: dict, reason: str | None) -> dict:
        end = time.monotonic_ns()
        return {"done_reason": DONE_REASONS.get(reason, reason),
                "total_duration": end - self.began, "load_duration": 0,
                "prompt_eval_count": usage["prompt_tokens"],
                "prompt_eval_duration": self.first - self.began,
                "eval_count": usage["completion_tokens"], "eval_duration": end - self.first}

    def full(self, answer: dict) -> dict:
        choice = answer["choices"][0]
        if self.fmt.chat:
            msg = choice["message"]
            part = self.part(msg["content"] or "", msg.get("reasoning_content"),
                             tool_calls(msg.get("tool_calls") or []))
        else:
            part = self.part(choice["text"])
        out = dict(self.obj(part, done=True), **self.figures(answer["usage"],
                                                            choice["finish_reason"]))
        if choice["logprobs"]:
            out["logprobs"] = choice["logprobs"]["content"] if self.fmt.chat \
                else completion_logprobs(choice["logprobs"])
        return out

    def opening(self, num_choices: int) -> list[bytes]:
        return []

    def events(self, chunk: dict) -> list[bytes]:
        choice = chunk_choice(chunk)
        if choice is None:
            return []
        if self.fmt.chat:
            delta = choice["delta"]
            for call in delta.get("tool_calls") or []:
                self._gather(call)
            content, thinking = delta.get("content") or "", delta.get("reasoning_content")
        else:
            content, thinking = choice["text"], None
        out = []
        lps = choice["logprobs"]
        if content or thinking or lps:
            obj = self.obj(self.part(content, thinking))
            if lps:
                obj["logprobs"] = lps["content"] if self.fmt.chat else completion_logprobs(lps)
            out.append(ndjson(obj))
        if choice["finish_reason"]:
            self.reason = choice["finish_reason"]
            if self.calls:
                calls = tool_calls([self.calls[i] for i in sorted(self.calls)])
                out.append(ndjson(self.obj(self.part("", calls=calls))))
        return out

    def _gather(self, delta: dict) -> None:
        call = self.calls.setdefault(delta["index"], {"id": None, "function": {
            "name": "", "arguments": ""}})
        call["id"] = call["id"] or delta.get("id")
        call["function"]["name"] += delta["function"].get("name") or ""
        call["function"]["arguments"] += delta["function"].get("arguments") or ""

    def closing(self, usage: dict) -> list[bytes]:
        return [ndjson(dict(self.obj(self.part("")), done=True,
                            **self.figures(usage, self.reason)))]

    def failed(self, error: ApiError) -> list[bytes]:
        return [ndjson({"error": error.message})]

    @staticmethod
    def error_body(error: ApiError) -> dict:
        return {"error": error.message}


class OllamaGenerate(OllamaChat):
    """/api/generate's answers: the text as "response" (a chat request's reasoning as
    "thinking"), whether the prompt went through the chat template or not."""

    def part(self, content: str, thinking: str | None = None,
             calls: list[dict] | None = None) -> dict:
        return {"response": content, **({"thinking": thinking} if thinking else {})}
