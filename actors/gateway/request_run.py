"""The sequences of one HTTP request (completions or chat), as the gateway's handler waits on
them: the replies routed to its queue, turned into choices, usage and errors."""
from __future__ import annotations

import asyncio

from pagewire.wire.ids import SeqId, output_ids
from pagewire.wire.sampling_params import best_of
from pagewire.wire.to_gateway import RequestFailed, TextDelta
from pagewire.wire.to_tokenizer import TokenizeRequest

from .protocol import ApiError
from .responses import Choice, usage


class RequestRun:
    """The sequences of one HTTP request, and their replies as they arrive on `queue`.

    Prompt i is request "<id>-i" (its refusals come by that id), its sequences
    output_ids("<id>-i", num_outputs); sequence j of prompt i is choice i*n + j. Iterating
    yields (choice index, TextDelta) until every sequence has finished, removing finished ids
    from `open_ids` (what is left is aborted when the handler ends). A failed sequence raises
    ApiError. A delta rebuilt after a detokenizer restart carries its output's whole text
    (from_start): the part already received (`received`, characters) is cut off, so the
    client never gets text twice.
    """

    def __init__(self, prompts: list[TokenizeRequest]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_ids = [p.req_id for p in prompts]
        sampling = prompts[0].sampling
        self.n, self.num_outputs = sampling.n, sampling.num_outputs
        self.num_choices = len(prompts) * self.n
        self.slot: dict[SeqId, tuple[int, int]] = {
            out_id: (i, j) for i, p in enumerate(prompts)
            for j, out_id in enumerate(output_ids(p.req_id, self.num_outputs))}
        self.open_ids = set(self.slot)
        self.buffer: list[TextDelta] = []
        self.choices: dict[tuple[int, int], Choice] = {slot: Choice() for slot in self.slot.values()}
        self.prompt_tokens: dict[int, int] = {}
        self.output_tokens: dict[tuple[int, int], int] = {}
        self.received: dict[SeqId, int] = {}       # characters of text each output sent
        self.done: set[tuple[int, int]] = set()     # slots finished (a rebuilt copy is dropped)

    def route_ids(self) -> list[str | SeqId]:
        return self.prompt_ids + list(self.slot)

    async def first_replies(self) -> None:
        """Wait until every prompt has answered once; a refusal (bad prompt, too long, queue
        full) becomes the HTTP error before any response byte is sent."""
        answered = set()
        while len(answered) < len(self.prompt_ids):
            msg = await self.queue.get()
            if isinstance(msg, RequestFailed):
                self.open_ids -= {o for o, (i, _) in self.slot.items()
                                  if self.prompt_ids[i] == msg.req_id}
                raise ApiError(msg.status, msg.message, msg.param, msg.error_type)
            if msg.finish_reason == "rejected":
                self.open_ids.discard(msg.seq_id)
                raise ApiError(503, msg.error or "the server is overloaded")
            answered.add(self.slot[msg.seq_id][0])
            self.prompt_tokens[self.slot[msg.seq_id][0]] = msg.num_prompt_tokens
            self.buffer.append(msg)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, TextDelta]:
        if not self.open_ids and not self.buffer:
            raise StopAsyncIteration
        delta = self.buffer.pop(0) if self.buffer else await self.queue.get()
        if isinstance(delta, RequestFailed):       # the engine failed this request
            raise ApiError(delta.status, delta.message, delta.param, delta.error_type)
        if delta.seq_id not in self.slot or self.slot[delta.seq_id] in self.done:
            return await self.__anext__()
        delta = self.fresh(delta)
        if delta is None:
            return await self.__anext__()
        i, j = slot = self.slot[delta.seq_id]
        if delta.finish_reason:
            self.open_ids.discard(delta.seq_id)
            self.done.add(slot)
        if delta.finish_reason in ("error", "rejected"):
            raise ApiError(500 if delta.finish_reason == "error" else 503,
                           delta.error or "generation failed")
        self.prompt_tokens[i] = delta.num_prompt_tokens
        self.output_tokens[slot] = delta.num_output_tokens
        self.choices[slot].add(delta)
        return i * self.n + j, delta

    def fresh(self, delta: TextDelta) -> TextDelta | None:
        """The delta's text not received before (None: nothing new)."""
        had = self.received.get(delta.seq_id, 0)
        if delta.from_start:
            delta.text, delta.from_start = delta.text[had:], False
            if not delta.text and not delta.finish_reason:
                return None
        self.received[delta.seq_id] = had + len(delta.text)
        return delta

    def best_choices(self) -> dict[int, Choice]:
        """Choices by index: per prompt, the n sequences with the highest cumulative logprob
        when it generated more (best_of)."""
        out = {}
        for i in range(len(self.prompt_ids)):
            picked = best_of([self.choices[(i, j)].cumulative_logprob
                              for j in range(self.num_outputs)], self.n)
            for k, j in enumerate(picked):
                out[i * self.n + k] = self.choices[(i, j)]
        return out

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens.values()), sum(self.output_tokens.values()))
