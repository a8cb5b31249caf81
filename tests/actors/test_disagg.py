"""Disaggregated prefill and decode between two engines in this process over loopback TCP: a
prefill engine computes prompts and holds their blocks under leases, a decode engine pulls
them and continues with the tokens one engine alone gives. A lease that expired, a prefill
engine that is gone, a prompt whose blocks differ, and an abort while waiting each leave both
pools whole, the request recomputed (or failed, under kv_load_failure_policy fail)."""
from __future__ import annotations

import socket
import time

import pytest

from pagewire import LLM, SamplingParams
from pagewire.config import KVTransferConfig
from pagewire.scheduler.request import Status
from pagewire.wire.kv_transfer import KvPulled, KvSource, KvTransfer
from tests.actors.sched_helpers import assert_pool_whole, make_scheduler, new, sid, step

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + 31 * i + j for j in range(26 + i)]} for i in range(3)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(path: str, **transfer) -> LLM:
    return LLM(path, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128,
               kv_transfer_config=transfer or None)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _pool_whole(llm: LLM) -> bool:
    llm.generate([])                       # takes the lease notices the KV server posted
    kv = llm.scheduler.kv
    return kv.num_free == kv.num_blocks and not any(kv.refcount) and not llm.scheduler.tables.leases


@pytest.fixture(scope="module")
def engines(tmp_path_factory, smol_tokenizer_dir):
    from tests.helpers import make_tiny_llama
    path = make_tiny_llama(str(tmp_path_factory.mktemp("pd") / "m"), smol_tokenizer_dir)
    port = free_port()
    alone = _engine(path)
    producer = _engine(path, kv_role="kv_producer", kv_port=port,
                       kv_connector_extra_config={"lease_seconds": 30})
    consumer = _engine(path, kv_role="kv_consumer",
                       kv_connector_extra_config={"pull_timeout": 0.5})
    return {"path": path, "port": port, "alone": alone, "producer": producer,
            "consumer": consumer, "expected": alone.generate(PROMPTS, GREEDY)}


def test_decode_after_a_remote_prefill_gives_one_engines_tokens(engines):
    prefilled = engines["producer"].generate(PROMPTS, PREFILL,
                                             kv_transfer_params={"do_remote_decode": True})
    params = [o.kv_transfer_params for o in prefilled]
    assert params[0]["remote_port"] == engines["port"] and params[0]["do_remote_prefill"]
    assert [p["remote_request_id"] for p in params] == [o.request_id for o in prefilled]
    assert len(engines["producer"].scheduler.tables.leases) == 3
    consumer = engines["consumer"]
    before = consumer.scheduler.tables.external_hits
    outs = consumer.generate(PROMPTS, GREEDY, kv_transfer_params=params)
    assert _tokens(outs) == _tokens(engines["expected"])
    for ours, theirs in zip(outs, engines["expected"]):
        assert [lp.logprob for lp in ours.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in theirs.outputs[0].logprobs], abs=1e-4)
    # Full blocks below the last prompt token: 25, 26, 27 tokens -> 6, 6, 6 blocks of 4.
    assert consumer.scheduler.tables.external_hits - before == 3 * 6 * 4
    deadline = time.monotonic() + 5                 # releases reach the KV server's thread
    while engines["producer"].runner.kv_server.leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pool_whole(engines["producer"]) and _pool_whole(consumer)


def _prefill_one(engines, i: int = 0) -> dict:
    (out,) = engines["producer"].generate([PROMPTS[i]], PREFILL,
                                          kv_transfer_params={"do_remote_decode": True})
    return out.kv_transfer_params


def test_an_expired_lease_is_recomputed_with_the_same_tokens(engines):
    params = _prefill_one(engines)
    server = engines["producer"].runner.kv_server
    server.leases[params["remote_request_id"]] = (server.leases[params["remote_request_id"]][0],
                                                  time.monotonic() - 1)   # past its deadline
    time.sleep(0.5)                                 # the server's thread expires it
    assert _pool_whole(engines["producer"])         # freed on expiry, before any pull
    consumer = engines["consumer"]
    before = consumer.scheduler.tables.external_hits
    (out,) = consumer.generate([PROMPTS[0]], GREEDY, kv_transfer_params=params)
    assert out.outputs[0].token_ids == _tokens(engines["expected"])[0]
    assert consumer.scheduler.tables.external_hits == before
    assert _pool_whole(consumer)


def test_a_prompt_whose_blocks_differ_gets_none_of_them(engines):
    params = _prefill_one(engines, 1)               # the lease holds prompt 1's blocks
    consumer = engines["consumer"]
    before = consumer.scheduler.tables.external_hits
    (out,) = consumer.generate([PROMPTS[2]], GREEDY, kv_transfer_params=params)
    assert out.outputs[0].token_ids == _tokens(engines["expected"])[2]
    assert consumer.scheduler.tables.external_hits == before
    time.sleep(0.3)
    assert _pool_whole(engines["producer"]) and _pool_whole(consumer)   # released all the same


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_engine_that_is_gone(engines, policy):
    gone = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
            "remote_request_id": "cmpl-x-0"}
    consumer = _engine(engines["path"], kv_role="kv_consumer", kv_load_failure_policy=policy,
                       kv_connector_extra_config={"pull_timeout": 0.3})
    (out,) = consumer.generate([PROMPTS[0]], GREEDY, kv_transfer_params=gone)
    if policy == "recompute":
        assert out.outputs[0].token_ids == _tokens(engines["expected"])[0]
    else:
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert _pool_whole(consumer)


def test_roles_are_checked():
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="decoder").check()
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig(kv_connector_extra_config={"lease": 1}).check()


def decode_after_remote_prefill(max_tokens: int):
    """A consumer's scheduler and request "d" (9 tokens) whose prefix a prefill engine holds."""
    s = make_scheduler(num_blocks=8, block_size=4, max_len=32,
                       kv_transfer_config=KVTransferConfig(kv_role="kv_consumer"))
    msg = new("d", 9, first=100, max_tokens=max_tokens)
    msg.kv_transfer = KvTransfer(remote_prefill=KvSource("tcp://127.0.0.1:1", "p-0"))
    s.add(msg)
    return s


def test_an_abort_while_pulling_holds_the_table_until_the_pull_ends():
    s = decode_after_remote_prefill(max_tokens=2)
    plan = s.schedule()
    (pull,) = plan.pulls
    assert pull.seq_id == sid("d") and pull.block_ids == [0, 1] and len(pull.hashes) == 2
    assert s.kv.num_free == 8 - 3                    # its whole table: 3 blocks
    s.update(plan, s.run())                          # the step goes on; the pull does too
    assert s.seqs[sid("d")].status is Status.LOADING and s.schedule() is None
    s.abort(["d"])
    assert s.kv.num_free == 8 - 3                    # the puller may still write them
    s.send(KvPulled({sid("d"): 2}))
    assert not s.has_work() and not s.arrivals.pulling
    assert_pool_whole(s)


def test_a_pull_that_ends_puts_its_sequence_back_in_line():
    s = decode_after_remote_prefill(max_tokens=1)
    s.update(s.schedule(), s.run())
    s.send(KvPulled({sid("d"): 1}))                  # one of two blocks came
    plan, _ = step(s)
    assert (plan.new[0].num_computed, plan.new[0].num_scheduled) == (4, 5)
    assert s.tables.external_hits == 4
    assert_pool_whole(s)


def test_a_producer_holds_an_ended_requests_full_blocks_until_the_lease_ends():
    from pagewire.wire.kv_transfer import KvLeaseEnded
    s = make_scheduler(num_blocks=8, block_size=4, max_len=32,
                       kv_transfer_config=KVTransferConfig(kv_role="kv_producer"))
    msg = new("p", 9, first=100, max_tokens=1)
    msg.kv_transfer = KvTransfer(remote_decode=True)
    s.add(msg)
    step(s)
    plan, _ = step(s)                                # the lease goes to the executor
    (lease,) = plan.leases
    assert (lease.lease, lease.block_ids) == ("p", [0, 1])
    assert s.kv.num_free == 6 and s.kv.refcount[:3] == [1, 1, 0]
    s.send(KvLeaseEnded("p"))
    assert_pool_whole(s)
