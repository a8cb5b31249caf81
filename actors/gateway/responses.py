"""The OpenAI protocol's responses: whole answers and stream chunks of both endpoints, with
their logprobs; a chat choice's message is shaped by chat_output.py (reasoning, tool calls).
No I/O here."""
from __future__ import annotations

import msgspec

from pagewire.wire.to_gateway import TextDelta, TokenLogprob

from .chat_output import ChatOutput
from .tools import ToolPlan


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Choice:
    """One output sequence's response so far, as its TextDeltas arrive."""

    def __init__(self):
        self.text = ""
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []
        self.echo = ""
        self.cumulative_logprob = 0.0

    def add(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs or []
        self.prompt_logprobs += delta.prompt_logprobs or []
        self.echo += delta.echo_prompt or ""
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            self.cumulative_logprob = delta.cumulative_logprob or 0.0


def as_token_ids(entries: list[TokenLogprob]) -> list[TokenLogprob]:
    """vLLM's return_tokens_as_token_ids: each token, sampled or alternative, named
    "token_id:N" (text that does not decode alone stays unambiguous)."""
    return [msgspec.structs.replace(e, token=f"token_id:{e.token_id}",
                                    top=[(t, f"token_id:{t}", lp) for t, _, lp in e.top])
            for e in entries]


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict:
    """OpenAI's completions logprobs: parallel lists, text_offset counted from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.token)
        out["token_logprobs"].append(e.logprob)
        top = {text: lp for _, text, lp in e.top}
        if e.logprob is not None:
            top.setdefault(e.token, e.logprob)
        out["top_logprobs"].append(top if e.logprob is not None else None)
        out["text_offset"].append(offset)
        offset += len(e.token)
    return out


def chat_logprobs_content(entries: list[TokenLogprob]) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [dict(item(e.token, e.logprob),
                             top_logprobs=[item(t, lp) for _, t, lp in e.top])
                        for e in entries], "refusal": None}


def prompt_logprobs_list(entries: list[TokenLogprob]) -> list:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob,
    decoded_token}} with the actual token and the top alternatives."""
    out = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        d = {str(tid): {"logprob": lp, "decoded_token": text} for tid, text, lp in e.top}
        d.setdefault(str(e.token_id), {"logprob": e.logprob, "decoded_token": e.token})
        out.append(d)
    return out


class Formatter:
    """Response shapes for one endpoint. `chat` picks chat.completion vs text_completion;
    `logprobs` whether choices carry them."""

    def __init__(self, chat: bool, req_id: str, created: int, model: str,
                 logprobs: bool = False, prompt_logprobs: bool = False, echo: bool = False,
                 token_ids: bool = False, tools: ToolPlan | None = None,
                 reasoning_parser: str | None = None):
        self.chat, self.id, self.created, self.model = chat, req_id, created, model
        self.logprobs, self.prompt_logprobs, self.echo = logprobs, prompt_logprobs, echo
        self.view = as_token_ids if token_ids else list
        self.tools, self.reasoning_parser = tools or ToolPlan(), reasoning_parser
        self.outputs: dict[int, ChatOutput] = {}      # streamed chat choices, by index
        self.kv_transfer_params: dict | None = None  # a prefill engine's answer (disagg.py)

    def chat_output(self) -> ChatOutput:
        return ChatOutput(self.tools, self.reasoning_parser)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, choices: dict[int, Choice], use: dict) -> dict:
        out = self._envelope("chat.completion" if self.chat else "text_completion",
                             [self._full_choice(i, choices[i]) for i in sorted(choices)])
        out["usage"] = use
        if self.kv_transfer_params and all(choices[i].finish_reason in ("stop", "length")
                                           for i in choices):
            out["kv_transfer_params"] = self.kv_transfer_params
        return out

    def _full_choice(self, index: int, c: Choice) -> dict:
        choice = {"index": index, "logprobs": None, "finish_reason": c.finish_reason}
        if self.chat:
            choice["message"], choice["finish_reason"] = \
                self.chat_output().message(c.text, c.finish_reason)
            if self.logprobs:
                choice["logprobs"] = chat_logprobs_content(self.view(c.logprobs))
        else:
            choice["text"] = c.echo + c.text
            if self.logprobs:
                entries = (c.prompt_logprobs if c.echo else []) + c.logprobs
                choice["logprobs"] = completion_logprobs(self.view(entries))
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_list(c.prompt_logprobs)
        return choice

    def role_chunk(self, index: int) -> dict:
        return self._chat_chunk(index, {"role": "assistant", "content": ""}, None)

    def chunks(self, index: int, delta: TextDelta) -> list[dict]:
        """The stream events one delta of choice `index` makes (none, one or more)."""
        entries = self.view(delta.logprobs or [])
        if not self.chat:
            echo = delta.echo_prompt or ""
            if self.echo:
                entries = self.view(delta.prompt_logprobs or []) + entries
            if not (delta.text or entries or echo or delta.finish_reason):
                return []
            choice = {"index": index, "text": echo + delta.text,
                      "finish_reason": delta.finish_reason,
                      "logprobs": completion_logprobs(entries) if self.logprobs and entries
                      else None}
            return [self._envelope("text_completion", [choice])]
        out = self.outputs.setdefault(index, self.chat_output())
        deltas = out.feed(delta.text)
        reason = None
        if delta.finish_reason:
            rest, reason = out.finish(delta.finish_reason)
            deltas += rest
        if self.logprobs and entries and not deltas:
            deltas = [{}]               # held text's logprobs go out as they come
        chunks = [self._chat_chunk(index, d, None) for d in deltas]
        if self.logprobs and entries:
            chunks[0]["choices"][0]["logprobs"] = chat_logprobs_content(entries)
        if reason:
            chunks.append(self._chat_chunk(index, {}, reason))
        return chunks

    def _chat_chunk(self, index: int, delta: dict, finish_reason: str | None) -> dict:
        return self._envelope("chat.completion.chunk", [
            {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}])

    def usage_chunk(self, use: dict) -> dict:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = use
        return out
