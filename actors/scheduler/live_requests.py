"""The scheduler's index of live requests and their sequences, and the admission of a new
request into it.

A request lives while one of its sequences does. Sequences are found by id (`seqs`), beam
searches by request id (`groups`), and RUNNING or WAITING / SWAPPED sequences sit in the
`running` or `waiting` queue, each sorted by key (priority, arrival); LOADING ones wait in
Arrivals instead (arrivals.py). Ids aborted before their request arrived are remembered (the
last _FORGET_ABORTS), so that the request is refused when it comes.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict

from pagewire.model_info import WHOLE_IMAGE_ARCHITECTURES
from pagewire.wire.ids import PROMPT, SeqId, output_ids
from pagewire.wire.to_detokenizer import TokenDelta
from pagewire.wire.to_scheduler import NewRequest

from .beam import BeamGroup
from .prompt_stream import StreamState
from .request import Request, Sequence, Status

_FORGET_ABORTS = 10_000   # aborted-before-arrival ids remembered


class LiveRequests:
    def __init__(self):
        self.requests: dict[str, Request] = {}   # by request id
        self.seqs: dict[SeqId, Sequence] = {}    # their live sequences, by id
        self.groups: dict[str, BeamGroup] = {}   # beam searches, by request id
        self.waiting: list[Sequence] = []        # sorted by key
        self.running: list[Sequence] = []        # sorted by key
        self.aborted_early: OrderedDict[SeqId, None] = OrderedDict()

    def open(self, msg: NewRequest, config,
             by_priority: bool) -> tuple[Sequence | None, list[TokenDelta]]:
        """A new request's first sequence, tracked and queued; or None and its outputs' final
        deltas if it was aborted before it came, is a duplicate, can never run or finds the
        queue full. `config`: the EngineConfig; `by_priority`: the priority policy is on (else
        every request's priority is 0)."""
        outputs = output_ids(msg.req_id, msg.sampling.num_outputs)
        early = [o for o in outputs if o in self.aborted_early]
        if early or msg.req_id in self.requests:   # or a duplicate
            for o in early:
                del self.aborted_early[o]
            return None, [TokenDelta(o, [], "abort") for o in outputs]
        refusal = queue_refusal(msg, config, self.waiting)
        if refusal:
            reason, error = refusal
            return None, [TokenDelta(o, [], reason, error) for o in outputs]
        priority = msg.priority if by_priority else 0
        seq = open_request(msg, config.model.max_model_len, priority)
        if msg.sampling.use_beam_search:
            group = self.groups[msg.req_id] = BeamGroup(msg.req_id, msg.sampling,
                                                        seq.max_tokens)
            seq.seq_id, seq.request.group = group.new_id(), group
            group.live.append(seq)
        self.requests[msg.req_id] = seq.request
        self.track(seq)
        return seq, []

    def track(self, seq: Sequence) -> None:
        """A new sequence of a live request: known by its id, and queued by its status."""
        seq.request.seqs.append(seq)
        self.seqs[seq.seq_id] = seq
        self.enqueue(seq)

    def enqueue(self, seq: Sequence) -> None:
        """Into its status's queue (running, else waiting), in key order."""
        queue = self.running if seq.status is Status.RUNNING else self.waiting
        bisect.insort(queue, seq, key=lambda s: s.key)

    def dequeue(self, seq: Sequence) -> None:
        """Out of the queue it is in (none while LOADING or FINISHED)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status in (Status.WAITING, Status.SWAPPED):
            self.waiting.remove(seq)

    def forget(self, seq: Sequence) -> None:
        """An ended sequence (already out of the queues); its request with its last one."""
        del self.seqs[seq.seq_id]
        req = seq.request
        req.seqs.remove(seq)
        if not req.seqs:
            del self.requests[req.req_id]
        if req.group is not None and seq in req.group.live:
            req.group.live.remove(seq)

    def ended_by_abort(self, sid: SeqId) -> list[Sequence]:
        """The sequences an abort of output `sid` ends: that one, its beam search's (the group
        is forgotten), or its unforked prompt; none for an id not known (remembered)."""
        prompt = SeqId(sid.req, PROMPT)
        if sid in self.seqs:
            return [self.seqs[sid]]
        if sid.req in self.groups:
            return list(self.groups.pop(sid.req).live)
        if prompt in self.seqs:
            return [self.seqs[prompt]]
        if sid not in self.aborted_early:
            self.aborted_early[sid] = None
            if len(self.aborted_early) > _FORGET_ABORTS:
                self.aborted_early.popitem(last=False)
        return []

    def output_ids(self) -> list[SeqId]:
        """Every live request's outputs, by the ids the detokenizer and gateway know."""
        return list(dict.fromkeys(i for seq in self.seqs.values() for i in seq.output_ids))


def open_request(msg: NewRequest, max_model_len: int, priority: int) -> Sequence:
    """A new request's record and its first sequence: its only one, or the fork leader of
    n / best_of outputs (a beam search's first beam gets its id from its BeamGroup)."""
    req = Request(msg.req_id, len(msg.prompt_token_ids), msg.sampling, msg.arrival_time,
                  max_model_len, priority, msg.cache_salt, msg.lora)
    req.transfer = msg.kv_transfer
    req.images = msg.images or None
    req.pooling = msg.pooling
    if msg.prompt_open:
        req.stream = StreamState()
    seq = Sequence(SeqId(msg.req_id), req, list(msg.prompt_token_ids))
    if msg.sampling.num_sequences > 1 and not msg.sampling.use_beam_search:
        seq.seq_id, seq.fork_leader = SeqId(msg.req_id, PROMPT), True
    return seq


def queue_refusal(msg: NewRequest, config,
                  waiting: list[Sequence]) -> tuple[str, str] | None:
    """(finish reason, error) for a request that can never run or finds the queue full;
    `config`: the EngineConfig (max_model_len and the queue limits)."""
    limit = config.model.max_model_len
    pooler = config.model.model_info.pooler
    if msg.pooling is not None and pooler is None:    # (the gateway refuses these first)
        return "error", "this model generates (--runner generate): it pools nothing"
    if msg.pooling is None and pooler is not None and not pooler.also_generates:
        return "error", "this model pools (--runner pooling): it generates nothing"
    # a pooled prompt may fill the context: nothing is generated after it
    if len(msg.prompt_token_ids) >= limit + (msg.pooling is not None):
        return "error", (f"prompt of {len(msg.prompt_token_ids)} tokens does not fit "
                         f"max_model_len={limit}")
    budget = config.scheduler.max_num_batched_tokens
    if msg.images and config.model.model_info.architecture in WHOLE_IMAGE_ARCHITECTURES and \
            any(im.length > budget for im in msg.images):
        return "error", (f"an image of {max(im.length for im in msg.images)} tokens does not fit "
                         f"one step (max_num_batched_tokens={budget}); "
                         f"{config.model.model_info.architecture}'s image tokens attend their "
                         f"whole image, so a prefill chunk cannot split one")
    max_reqs = config.scheduler.max_num_queued_reqs
    max_tokens = config.scheduler.max_num_queued_tokens
    if max_reqs is not None and len(waiting) >= max_reqs:
        return "rejected", f"the queue is full ({max_reqs} requests waiting)"
    if max_tokens is not None:
        queued = sum(r.num_pending for r in waiting) + len(msg.prompt_token_ids)
        if queued > max_tokens:
            return "rejected", f"the queue is full (over {max_tokens} prompt tokens waiting)"
    return None
