"""What a stateless actor's death must not lose, in-process: the scheduler ignores a resent
NewRequest and rebuilds a restarted detokenizer (DetokResync) from its record; the detokenizer
drops duplicate starts and stale deltas; the gateway cuts rebuilt text it already has and
resends what a dead tokenizer held (tokenizer_pool.py). The same fault run with real
processes: tests/e2e/test_faults.py."""
from __future__ import annotations

import time

import pytest
import zmq

from pagewire.detokenizer import Detokenizer
from pagewire.gateway.request_run import RequestRun
from pagewire.gateway.tokenizer_pool import TokenizerPool
from pagewire.scheduler.detok_record import RETAIN_ENDED_S, DetokRecord
from pagewire.wire.channels import PullChannel, ipc_address, make_run_dir
from pagewire.wire.ids import SeqId
from pagewire.wire.sampling_params import SamplingParams
from pagewire.wire.to_detokenizer import DetokResync, TokenDelta, TokenDeltas, detok_start
from pagewire.wire.to_gateway import EngineEvent, TextDeltas
from pagewire.wire.to_scheduler import Abort, DetokenizerStarted, NewRequest
from pagewire.wire.to_tokenizer import (TokenizeOnly, TokenizePiece, TokenizerInbox,
                                        TokenizeRequest)
from tests.actors.sched_helpers import make_scheduler, step

TEXT = "Héllo wörld 日本語 🙂 then STOP and more 𝔘𝔫𝔦 never sent"


@pytest.fixture(scope="module")
def tokenizer():
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model
    return load_tokenizer(resolve_model(None))


def _request(tokenizer, rid="a", **sampling) -> NewRequest:
    prompt = tokenizer.encode("Tell me something.")
    return NewRequest(req_id=rid, prompt_token_ids=prompt, arrival_time=0.0,
                      sampling=SamplingParams(max_tokens=200, **sampling))


class Gateway:
    """The gateway's side of one output: RequestRun's cut of rebuilt text, and the text its
    client got."""

    def __init__(self):
        self.run = RequestRun([TokenizeRequest(req_id="a", arrival_time=0.0,
                                               sampling=SamplingParams())])
        self.text, self.finish = "", None

    def take(self, sends) -> list:
        """The gateway's deltas delivered; returns the aborts the detokenizer sent."""
        aborts = []
        for channel, msg in sends:
            if isinstance(msg, TextDeltas):
                for d in msg.deltas:
                    d = self.run.fresh(d)
                    if d is not None and self.finish is None:
                        self.text += d.text
                        self.finish = d.finish_reason
            elif isinstance(msg, Abort):
                aborts.append(msg)
        return aborts


def _run(tokenizer, ids, kill_at=None, lost=2):
    """Drive a scheduler, a detokenizer and the gateway over `ids` (one token a step); with
    kill_at, the detokenizer dies after that many steps: its last text and the next `lost`
    steps' deltas vanish, the one after waits in the socket, then the new one starts."""
    sched = make_scheduler(num_blocks=128, max_len=128)
    req = _request(tokenizer, stop=["STOP"])
    start = detok_start(req.req_id, req.prompt_token_ids, req.sampling)
    detok, gateway = Detokenizer(tokenizer), Gateway()
    sched.send(req)
    gateway.take(detok.handle(start))
    queued = []
    for i, tok in enumerate(ids):
        _, deltas = step(sched, default=tok)
        if kill_at is not None and i == kill_at:
            detok, kill_at = None, None                    # its outbound text is gone too
            gateway.text = gateway.text[:max(0, len(gateway.text) - 3)]
            gateway.run.received[SeqId("a")] = len(gateway.text)
            countdown = lost
        if detok is None:
            if countdown > 0:
                countdown -= 1                             # lost in the dead one's socket
                continue
            queued.append(TokenDeltas(deltas))             # waits for the new one
            detok = Detokenizer(tokenizer)
            for msg in queued + [m for _, m in sched.core.handle(DetokenizerStarted())]:
                for abort in gateway.take(detok.handle(msg)):
                    sched.send(abort)
        else:
            for abort in gateway.take(detok.handle(TokenDeltas(deltas))):
                sched.send(abort)
        if gateway.finish:
            break
    return gateway, sched, detok


@pytest.mark.parametrize("kill_at", [3, 9, 14])
def test_a_restarted_detokenizer_continues_the_text_without_gap_or_repeat(tokenizer, kill_at):
    ids = tokenizer.encode(TEXT)
    expected, _, _ = _run(tokenizer, ids)
    assert expected.text == TEXT[:TEXT.index("STOP")] and expected.finish == "stop"
    got, sched, detok = _run(tokenizer, ids, kill_at=kill_at)
    assert (got.text, got.finish) == (expected.text, "stop")
    sched.send(Abort([SeqId("a")]))              # the scheduler ends it (the stop's abort)
    assert not sched.requests and not detok.live


def test_a_resent_new_request_is_ignored_while_held_and_once_ended(tokenizer):
    sched = make_scheduler(num_blocks=128, max_len=128)
    req = _request(tokenizer)
    assert sched.send(req) == []
    step(sched, default=7)
    assert sched.send(req) == []                          # no "abort" for the original
    assert len(sched.requests) == 1 and len(sched.running) == 1
    _, deltas = step(sched, default=8)
    assert deltas == [TokenDelta(SeqId("a"), [8])]
    sched.send(Abort([SeqId("a")]))
    assert sched.send(req) == [] and not sched.has_work()  # ended lately: not run again
    (resync,) = [m for _, m in sched.core.handle(DetokenizerStarted())]
    assert isinstance(resync, DetokResync)
    assert resync.starts == [detok_start("a", req.prompt_token_ids, req.sampling)]
    assert [(o.seq_id, o.token_ids, o.finish_reason) for o in resync.outputs] == [
        (SeqId("a"), [7, 8], "abort")]


def test_the_record_forgets_ended_requests_after_the_retention(tokenizer):
    now = [100.0]
    record = DetokRecord(clock=lambda: now[0])
    req = _request(tokenizer, n=2)
    assert record.opened(req) and not record.opened(req)
    record.sent([TokenDelta(SeqId("a", 0), [5, 6]), TokenDelta(SeqId("a", 1), [9], "stop")])
    assert [(o.token_ids, o.finish_reason) for o in record.resync().outputs] == [
        ([5, 6], None), ([9], "stop")]
    record.sent([TokenDelta(SeqId("a", 0), [7], "length")])
    now[0] += RETAIN_ENDED_S - 1
    assert len(record.resync().starts) == 1 and not record.opened(req)
    now[0] += 2
    assert record.resync() == DetokResync([], [])
    assert record.opened(req)                              # forgotten: new again


def test_the_detokenizer_drops_a_duplicate_start_of_a_live_or_finished_output(tokenizer):
    detok = Detokenizer(tokenizer)
    start = detok_start("a", [1, 2, 3], SamplingParams())
    ids = tokenizer.encode("one two")
    detok.handle(start)
    first = detok.handle(TokenDeltas([TokenDelta(SeqId("a"), ids[:1])]))
    assert detok.handle(start) == []                       # live: not reset
    rest = detok.handle(TokenDeltas([TokenDelta(SeqId("a"), ids[1:], "length")]))
    text = first[0][1].deltas[0].text + rest[0][1].deltas[0].text
    assert text == "one two" and not detok.live
    assert detok.handle(start) == [] and not detok.live    # over: not started again


@pytest.fixture
def pool():
    ctx = zmq.Context()
    run_dir = make_run_dir()
    inboxes = [PullChannel(ctx, ipc_address(run_dir, f"tokenizer-{i}"), TokenizerInbox)
               for i in range(2)]
    pool = TokenizerPool(ctx, lambda name: ipc_address(run_dir, name), 2)
    yield pool, inboxes
    for channel in pool.channels + inboxes:
        channel.sock.setsockopt(zmq.LINGER, 0)
        channel.close()
    ctx.term()


def _received(inbox, count: int) -> list[str]:
    """The ids of the next `count` messages, and no more."""
    out, deadline = [], time.monotonic() + 5
    while len(out) < count and time.monotonic() < deadline:
        msg = inbox.recv(50)
        if msg is not None:
            out.append(msg.req_id)
    assert inbox.recv(20) is None
    return out


def test_a_dead_tokenizers_unanswered_requests_are_resent_to_a_live_one(pool):
    pool, inboxes = pool
    msgs = [TokenizeOnly(req_id=f"r{i}", prompt="x") for i in range(6)]
    for msg in msgs:
        pool.send(msg)
    assert [_received(i, 3) for i in inboxes] == [["r0", "r2", "r4"], ["r1", "r3", "r5"]]
    pool.answered("r0")                                      # answered: not resent
    waiting = {"r0", "r1", "r2", "r3", "r5"}                 # r4's client went away
    assert pool.on_event(EngineEvent("lost", "died", "tokenizer 0"), waiting.__contains__) == []
    assert _received(inboxes[1], 1) == ["r2"]
    pool.send(TokenizeOnly(req_id="r6", prompt="x"))         # while 0 restarts: to 1 only
    pool.send(TokenizeOnly(req_id="r7", prompt="x"))
    assert _received(inboxes[1], 2) == ["r6", "r7"] and _received(inboxes[0], 0) == []
    pool.on_event(EngineEvent("back", "restarted", "tokenizer 0"), waiting.__contains__)
    for rid in ("r8", "r9"):
        pool.send(TokenizeOnly(req_id=rid, prompt="x"))
    assert _received(inboxes[0], 1) + _received(inboxes[1], 1) in (["r8", "r9"], ["r9", "r8"])
    assert set(pool.held) == {"r1", "r2", "r3", "r5", "r6", "r7", "r8", "r9"}
    pool.forget_gone(waiting.__contains__)
    assert set(pool.held) == {"r1", "r2", "r3", "r5"}


def test_a_streamed_prompt_on_a_dead_tokenizer_fails_and_is_not_resent(pool):
    pool, inboxes = pool
    stream = TokenizeRequest(req_id="s", arrival_time=0.0, sampling=SamplingParams(),
                             prompt="first", prompt_open=True)
    pool.send(TokenizeOnly(req_id="r0", prompt="x"))              # to tokenizer 0
    pool.send(TokenizeOnly(req_id="r1", prompt="x"))              # to tokenizer 1
    pool.send_pinned(stream)
    pool.send_pinned(TokenizePiece(req_id="s", reply_id="s:piece", prompt=" more"))
    assert _received(inboxes[0], 3) == ["r0", "s", "s"] and _received(inboxes[1], 1) == ["r1"]
    lost = EngineEvent("lost", "died", "tokenizer 0")
    assert pool.on_event(lost, {"r0", "r1", "s"}.__contains__) == ["s"]
    assert _received(inboxes[1], 1) == ["r0"] and _received(inboxes[0], 0) == []
    assert set(pool.held) == {"r0", "r1"} and not pool.pinned


def test_the_detokenizers_tokenizer_without_transformers_is_transformers_one(tokenizer):
    from pagewire.hf_tokenizer import load_backend_tokenizer
    from pagewire.model_info import resolve_model
    backend = load_backend_tokenizer(resolve_model(None))
    assert type(backend).__module__.startswith("tokenizers")
    assert backend.to_str() == tokenizer.backend_tokenizer.to_str()
