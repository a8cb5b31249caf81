"""KV cache events (--kv-events-config) from a scheduler core driven in process, published by
the scheduler's publisher and read by a subscriber written from vLLM's published schema (its
own structs below, in vLLM's field order), as a vLLM consumer reads them."""
from __future__ import annotations

import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from pagewire.scheduler.kv_manager import block_hashes
from pagewire.wire.channels import make_run_dir
from pagewire.wire.kv_event_publisher import KvEventPublisher
from pagewire.wire.kv_events import KVEventBatch as PublishedBatch

from .sched_helpers import assert_pool_whole, make_scheduler, new, step


# -- vLLM's event schema (vllm/distributed/kv_events.py, array layout), written out here --

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
EVENTS = {"enable_kv_cache_events": True, "topic": "kv"}


def ext(h: bytes) -> int:
    """vLLM's int block hash: the low 64 bits, big-endian."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def chain(tokens: list[int], block_size: int = 4) -> list[int]:
    """pagewire's block hashes of a prompt (no salt, KV dtype auto), as the events carry them."""
    return [ext(h) for h in block_hashes(tokens, block_size, "kv=auto\x00", [])]


def apply(held: set[int], batch: KVEventBatch) -> None:
    for e in batch.events:
        if isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update(e.block_hashes)
        else:
            held.clear()


def decoded(sched) -> KVEventBatch | None:
    batch = sched.core.take_kv_events()
    return None if batch is None else DECODER.decode(msgspec.msgpack.encode(batch))


def finish(sched, rid: str, steps: int = 20) -> list[KVEventBatch]:
    """Steps until nothing runs; each step's batch (decoded as a vLLM consumer does)."""
    batches = []
    for _ in range(steps):
        if not sched.has_work():
            break
        step(sched)
        batch = decoded(sched)
        if batch is not None:
            batches.append(batch)
    return batches


def test_events_name_exactly_the_blocks_stored_and_evicted():
    sched = make_scheduler(num_blocks=6, block_size=4, max_len=24, kv_events_config=EVENTS)
    first = decoded(sched)
    assert [type(e) for e in first.events] == [AllBlocksCleared]     # a fresh pool
    a = new("a", 10, first=100, max_tokens=3)       # 13 tokens: blocks 0-2 full once computed
    sched.add(a)
    batches = finish(sched, "a")
    stored = [e for b in batches for e in b.events]
    a_tokens = a.prompt_token_ids + [5, 5, 5]
    want = chain(a_tokens)
    assert all(isinstance(e, BlockStored) for e in stored)
    assert [h for e in stored for h in e.block_hashes] == want[:3]
    assert stored[0].parent_block_hash is None and stored[0].block_size == 4
    assert stored[0].token_ids == a_tokens[:4 * len(stored[0].block_hashes)]
    assert stored[-1].parent_block_hash == want[len(want[:3]) - len(stored[-1].block_hashes) - 1]
    assert (stored[0].medium, stored[0].lora_id, stored[0].lora_name) == ("GPU", None, None)

    # b shares a's first two blocks (a hit: nothing stored again), then fills the pool so
    # that a's cached blocks are evicted, least recently freed first: a's tail before its head.
    sched.add(new("b", 22, first=100, max_tokens=1))
    events = [e for b in finish(sched, "b") for e in b.events]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    b_stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    b_chain = chain(list(range(100, 122)))
    assert b_stored == b_chain[2:5]                   # blocks 2-4 new; 0-1 were a's
    assert removed == [want[2]]                       # a's third block made room
    held: set[int] = set()
    for batch in [first] + batches + [msgspec.msgpack.Decoder(KVEventBatch).decode(
            msgspec.msgpack.encode(msgspec.structs.replace(
                first, events=events)))]:
        apply(held, batch)
    assert held == {ext(h) for h in sched.kv.cached} == set(b_chain[:5])
    assert_pool_whole(sched)


def test_sleep_modes_cache_reset_is_published_as_all_blocks_cleared():
    sched = make_scheduler(num_blocks=6, block_size=4, max_len=24, kv_events_config=EVENTS)
    decoded(sched)
    sched.add(new("a", 10, first=100, max_tokens=3))
    finish(sched, "a")
    assert sched.kv.cached
    sched.tables.reset_prefix_cache()            # what a sleep or a weight update does
    assert [type(e) for e in decoded(sched).events] == [AllBlocksCleared]


def test_a_salted_or_adapter_request_chains_from_its_own_root():
    sched = make_scheduler(num_blocks=8, block_size=4, max_len=32, kv_events_config=EVENTS)
    decoded(sched)
    req = new("s", 9, first=100, max_tokens=1)
    sched.add(msgspec.structs.replace(req, cache_salt="tenant"))
    stored = [e for b in finish(sched, "s") for e in b.events]
    salted = [ext(h) for h in block_hashes(req.prompt_token_ids, 4, "kv=auto\x00tenant", [])]
    assert [h for e in stored for h in e.block_hashes] == salted[:2] != chain(req.prompt_token_ids)[:2]


class LegacyBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """vLLM's first BlockStored (five fields): older consumers decode the batches too."""
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]


class LegacyBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[LegacyBlockStored]


def test_vllms_first_event_structs_decode_the_batches_too():
    sched = make_scheduler(num_blocks=6, block_size=4, max_len=24, kv_events_config=EVENTS)
    sched.core.take_kv_events()
    sched.add(new("a", 9, first=100, max_tokens=1))
    step(sched)
    batch = msgspec.msgpack.Decoder(LegacyBatch).decode(
        msgspec.msgpack.encode(sched.core.take_kv_events()))
    assert [(e.block_hashes, e.token_ids) for e in batch.events] == \
        [(chain(list(range(100, 109)))[:2], list(range(100, 108)))]


def test_events_off_cost_nothing():
    sched = make_scheduler(num_blocks=6, block_size=4, max_len=24)
    assert sched.kv.events is None and sched.core.take_kv_events() is None


@pytest.fixture
def endpoints(tmp_path_factory):
    run_dir = make_run_dir(str(tmp_path_factory.mktemp("r")))
    return f"ipc://{run_dir}/kv", f"ipc://{run_dir}/replay"


class Subscriber:
    """vLLM's subscriber flow: [topic, seq, payload] on SUB; a gap asks the replay socket for
    the batches from the first missed number, answered up to an end marker (-1, b""). A
    DEALER with REQ's envelope (an empty frame first): a REQ socket takes one reply only."""

    def __init__(self, ctx, pub_at: str, replay_at: str):
        self.sub, self.replay = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(pub_at)
        self.replay.connect(replay_at)
        self.got: dict[int, KVEventBatch] = {}
        self.replayed: list[int] = []

    def receive(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_frame, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_frame, "big")
        assert topic == b"kv"
        if seq > len(self.got):                                  # missed some: replay
            self.replay.send_multipart([b"", len(self.got).to_bytes(8, "big")])
            while True:
                _, rseq, rpayload = self.replay.recv_multipart()
                if rpayload == b"":
                    assert int.from_bytes(rseq, "big", signed=True) == -1
                    break
                self.replayed.append(int.from_bytes(rseq, "big"))
                self.got.setdefault(self.replayed[-1], DECODER.decode(rpayload))
        self.got.setdefault(seq, DECODER.decode(payload))
        return True

    def close(self) -> None:
        self.sub.close(0)
        self.replay.close(0)


def test_a_subscriber_replays_what_it_missed(endpoints):
    pub_at, replay_at = endpoints
    sched = make_scheduler(num_blocks=6, block_size=4, max_len=24, kv_events_config=EVENTS)
    publisher = KvEventPublisher(pub_at, replay_at, topic="kv", buffer_steps=100)
    ctx = zmq.Context()
    publisher.publish(sched.core.take_kv_events())          # seq 0: nobody listens yet
    total = 1
    while not publisher.buffer:                              # (it is sent)
        time.sleep(0.001)
    sub = Subscriber(ctx, pub_at, replay_at)
    try:
        for _ in range(100):                                 # until the subscription lands
            publisher.publish(PublishedBatch(time.time(), []))
            total += 1
            if sub.receive(50):
                break
        assert sub.replayed[0] == 0                          # it missed 0 (and more)
        sched.add(new("a", 10, first=100, max_tokens=3))
        while sched.has_work():
            step(sched)
            batch = sched.core.take_kv_events()
            if batch is not None:
                publisher.publish(batch)
                total += 1
        while len(sub.got) < total and sub.receive(5000):
            pass
        assert sorted(sub.got) == list(range(total))
        held: set[int] = set()
        for seq in sorted(sub.got):
            apply(held, sub.got[seq])
        assert isinstance(sub.got[0].events[0], AllBlocksCleared)
        assert held == {ext(h) for h in sched.kv.cached} == set(chain(list(range(100, 110))
                                                                     + [5, 5])[:3])
    finally:
        publisher.close()
        sub.close()
        ctx.term()


def _replayed(ctx, endpoint: str) -> list[KVEventBatch]:
    """Every batch the publisher buffers, by a replay from 0."""
    replay = ctx.socket(zmq.DEALER)
    replay.connect(endpoint)
    try:
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert replay.poll(5000)
            _, seq, payload = replay.recv_multipart()
            if payload == b"":
                return batches
            assert int.from_bytes(seq, "big") == len(batches)
            batches.append(DECODER.decode(payload))
    finally:
        replay.close(0)


def test_the_offline_llm_publishes_as_the_scheduler_actor_does(tiny_llama, endpoints):
    from pagewire import LLM
    from pagewire.wire.sampling_params import SamplingParams
    pub_at, replay_at = endpoints
    llm = LLM(tiny_llama(), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              kv_events_config={**EVENTS, "endpoint": pub_at, "replay_endpoint": replay_at})
    prompt = list(range(10, 23))                     # 3 full blocks, a 4th once decoded
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True))
    ctx = zmq.Context()
    try:
        batches = _replayed(ctx, replay_at)
    finally:
        llm._kv_events.close()
        ctx.term()
    held: set[int] = set()
    for batch in batches:
        apply(held, batch)
    assert held == {ext(h) for h in llm.scheduler.kv.cached} \
        == set(chain(prompt + list(out.outputs[0].token_ids))[:4])


def test_events_need_prefix_caching_and_known_keys():
    with pytest.raises(ValueError, match="needs prefix caching"):
        make_scheduler(max_len=24, enable_prefix_caching=False, kv_events_config=EVENTS)
    with pytest.raises(ValueError, match="publisher"):
        make_scheduler(max_len=24, kv_events_config={**EVENTS, "publisher": "kafka"})
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        make_scheduler(max_len=24, kv_events_config={**EVENTS, "bogus": 1})
    off = make_scheduler(max_len=24, kv_events_config={"enable_kv_cache_events": False})
    assert off.kv.events is None
