"""The detokenizer actor: token ids -> text, incrementally, with stop strings.

Streamed text never holds half a UTF-8 character: tokens that end inside one produce no text
until the character completes (tokenizers' DecodeStream). When stop strings are set, the last
len(longest stop) - 1 characters are held back until they can no longer start a match; on a match
the text is cut there, the request finishes with "stop", and the scheduler is told to abort it so
its blocks are freed.

A restart loses nothing: the new detokenizer says DetokenizerStarted, and the scheduler answers
with a DetokResync, every request it holds or ended lately with all the tokens it sent
(scheduler/detok_record.py). Each output's text is rebuilt from its first token and sent whole
(from_start): the gateway drops the part it already has. Starts and deltas that the resync
covers are superseded, and a DetokStart of a request live or over already (a tokenizer's,
resent by the gateway) is dropped.
"""
from __future__ import annotations

from collections import OrderedDict

import msgspec
from tokenizers.decoders import DecodeStream

from pagewire.wire.channels import Sends
from pagewire.wire.ids import SeqId, output_ids
from pagewire.wire.sampling_params import LogprobsChunk
from pagewire.wire.to_detokenizer import (DetokenizerInbox, DetokResync, DetokStart, PromptGrew,
                                          TokenDelta, TokenDeltas)
from pagewire.wire.to_gateway import TextDelta, TextDeltas, TokenLogprob
from pagewire.wire.to_scheduler import Abort, DetokenizerStarted

from .hf_tokenizer import load_backend_tokenizer


_REMEMBER_ENDED = 10_000


class IncrementalText:
    """One request's output text. `sent` is how much of `text` the gateway has."""

    def __init__(self, backend, start: DetokStart):
        self.backend, self.start = backend, start
        self.stream = DecodeStream(skip_special_tokens=start.skip_special_tokens)
        for tid in start.prompt_tail:          # prime: the first output's text depends on them
            self.stream.step(backend, tid)
        self.text, self.sent, self.num_tokens = "", 0, 0
        self.holdback = max((len(s) for s in start.stop), default=1) - 1
        self.first_prompt = True           # the next prompt-logprobs chunk is the first
        self.echo = start.echo_prompt      # sent with the first delta

    def add(self, delta: TokenDelta) -> tuple[TextDelta, bool]:
        """Consume one TokenDelta; return the text delta to send and whether a stop string
        finished the request."""
        stopped = False
        for tid in delta.token_ids:
            self.num_tokens += 1
            piece = self.stream.step(self.backend, tid)
            if piece:
                old_len = len(self.text)
                self.text += piece
                if self.start.stop and self.num_tokens > self.start.min_tokens:
                    stopped = self._cut_at_stop(old_len)
            if stopped:
                break
        finish = "stop" if stopped else delta.finish_reason
        end = len(self.text) if finish else max(self.sent, len(self.text) - self.holdback)
        out = TextDelta(seq_id=delta.seq_id, text=self.text[self.sent:end],
                        num_prompt_tokens=self.start.num_prompt_tokens,
                        num_output_tokens=self.num_tokens, finish_reason=finish, error=delta.error,
                        cumulative_logprob=delta.cumulative_logprob,
                        logprobs=self._texts(delta.logprobs),
                        prompt_logprobs=self._texts(delta.prompt_logprobs, first=self.first_prompt),
                        pooled=delta.pooled)
        if delta.prompt_logprobs is not None:
            self.first_prompt = False
        out.echo_prompt, self.echo = self.echo, None
        self.sent = end
        return out, stopped

    def _texts(self, chunk: LogprobsChunk | None, first: bool = False) -> list[TokenLogprob] | None:
        """A logprobs chunk with each token's text. The prompt's first chunk starts with its
        first token, which nothing predicts (logprob None)."""
        if chunk is None:
            return None
        decode = self._token_text
        out = [TokenLogprob(self.start.first_prompt_token, decode(self.start.first_prompt_token),
                            None)] if first and self.start.first_prompt_token is not None else []
        for tid, lp, top_ids, top_lps in zip(chunk.token_ids, chunk.logprobs, chunk.top_ids,
                                             chunk.top_logprobs):
            out.append(TokenLogprob(tid, decode(tid), lp,
                                    [(t, decode(t), l) for t, l in zip(top_ids, top_lps)]))
        return out

    def _token_text(self, tid: int) -> str:
        return self.backend.decode([tid], skip_special_tokens=False)

    def _cut_at_stop(self, old_len: int) -> bool:
        """Cut at the first stop string that ends inside the piece appended after `old_len`
        (earlier matches were seen before, or fell within min_tokens and do not count)."""
        hits = [(i, s) for s in self.start.stop
                if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.start.include_stop_str_in_output else index]
        return True


class Detokenizer:
    """All live requests' text state.

    Deltas that arrive before their DetokStart (the two travel on different sockets) wait in
    `early` until it comes. A request finished here by a stop string stays in `stopped` until
    the scheduler confirms the abort with a final "abort" delta (it answers every Abort so),
    and deltas it sent meanwhile are dropped. An output that finished, or got an "abort" while
    not live, is remembered in `ended` (bounded), so a DetokStart that its abort overtook, or
    a duplicate one, is dropped when it arrives.
    """

    def __init__(self, tokenizer):
        """tokenizer: a transformers tokenizer, or its `tokenizers.Tokenizer` alone."""
        self.backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.live: dict[SeqId, IncrementalText] = {}
        self.early: dict[SeqId, list[TokenDelta]] = {}
        self.stopped: set[SeqId] = set()
        self.ended: OrderedDict[SeqId, None] = OrderedDict()   # over, or aborted unseen

    def handle(self, msg: DetokStart | PromptGrew | TokenDeltas | DetokResync) -> Sends:
        """The detokenizer core: text deltas for the gateway, and an Abort for the scheduler
        when stop strings finished requests."""
        if isinstance(msg, PromptGrew):
            self.prompt_grew(msg)
            return []
        step = self.start if isinstance(msg, DetokStart) else \
            self.resync if isinstance(msg, DetokResync) else self.on_deltas
        texts, aborts = step(msg)
        sends: Sends = [("gateway", TextDeltas(texts))] if texts else []
        return sends + ([("scheduler", Abort(aborts))] if aborts else [])

    def start(self, msg: DetokStart) -> tuple[list[TextDelta], list[SeqId]]:
        texts, aborts = [], []
        for out_id in output_ids(msg.req_id, msg.num_outputs):
            if out_id in self.live or out_id in self.ended:   # over already, or a duplicate
                continue
            self.live[out_id] = IncrementalText(self.backend, msg)
            t, a = self.on_deltas(TokenDeltas(self.early.pop(out_id, [])))
            texts += t
            aborts += a
        return texts, aborts

    def resync(self, msg: DetokResync) -> tuple[list[TextDelta], list[SeqId]]:
        """Rebuild every output the scheduler holds or ended lately from all its tokens; each
        sends its whole text so far (from_start), or nothing while it has none."""
        starts = {s.req_id: s for s in msg.starts}
        texts, aborts = [], []
        for out in msg.outputs:
            sid = out.seq_id
            self.early.pop(sid, None)
            self.stopped.discard(sid)
            self.ended.pop(sid, None)
            self.live[sid] = IncrementalText(self.backend, starts[sid.req])
            t, a = self.on_deltas(TokenDeltas([TokenDelta(sid, out.token_ids, out.finish_reason,
                                                          out.error, pooled=out.pooled)]))
            for delta in t:
                delta.from_start = True
            texts += [d for d in t if d.text or d.finish_reason]
            aborts += a
        return texts, aborts

    def _remember_ended(self, sid: SeqId) -> None:
        self.ended[sid] = None
        if len(self.ended) > _REMEMBER_ENDED:
            self.ended.popitem(last=False)

    def prompt_grew(self, msg: PromptGrew) -> None:
        """A streamed prompt (one output) grew: its usage counts the new tokens."""
        state = self.live.get(SeqId(msg.req_id))
        if state is not None:
            state.start = msgspec.structs.replace(
                state.start, num_prompt_tokens=state.start.num_prompt_tokens + msg.num_tokens)

    def on_deltas(self, msg: TokenDeltas) -> tuple[list[TextDelta], list[SeqId]]:
        """Returns the text deltas for the gateway and the sequences to abort at the
        scheduler (stop strings matched)."""
        out, aborts = [], []
        for delta in msg.deltas:
            state = self.live.get(delta.seq_id)
            if state is None:
                self._orphan(delta)
                continue
            text_delta, stopped = state.add(delta)
            out.append(text_delta)
            if text_delta.finish_reason:
                del self.live[delta.seq_id]
                self._remember_ended(delta.seq_id)
            if stopped and not delta.finish_reason:
                self.stopped.add(delta.seq_id)
                aborts.append(delta.seq_id)
        return out, aborts

    def _orphan(self, delta: TokenDelta) -> None:
        """A delta for a request that is not live: stopped here, not started yet, or over."""
        if delta.finish_reason == "abort":
            self._remember_ended(delta.seq_id)
            self.stopped.discard(delta.seq_id)
            self.early.pop(delta.seq_id, None)
        elif delta.seq_id not in self.stopped:
            self.early.setdefault(delta.seq_id, []).append(delta)


def prepare(config) -> Detokenizer:
    """The slow part of a start, which a warm spare does ahead (process.py)."""
    return Detokenizer(load_backend_tokenizer(config.model.model_info))


def run(env, prepared: Detokenizer | None = None) -> None:
    detok = prepared if prepared is not None else prepare(env.config)
    inbox = env.pull("detokenizer", DetokenizerInbox)
    pushes = {name: env.push(name) for name in ("gateway", "scheduler")}
    pushes["scheduler"].send(DetokenizerStarted())   # answered with a DetokResync
    env.ready()
    for msg in env.messages(inbox):
        for channel, out in detok.handle(msg):
            pushes[channel].send(out)
