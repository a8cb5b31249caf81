"""Every wire message round-trips through msgpack as itself; inboxes refuse foreign or broken
frames; SamplingParams validates on construction; wire/ never imports torch."""
from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from pagewire.wire import InvalidParam, SamplingParams
from pagewire.wire.channels import encode, make_decoder
from pagewire.wire.ids import PROMPT, SeqId, beam
from pagewire.wire.to_detokenizer import DetokenizerInbox, DetokStart, TokenDelta, TokenDeltas
from pagewire.wire.to_executor import ExecutorInbox, NewSeq, RunSeq, StepPlan
from pagewire.wire.to_gateway import (EngineReady, GatewayInbox, RequestFailed, SchedulerStats,
                                      TextDelta, TextDeltas)
from pagewire.wire.to_scheduler import (Abort, NewRequest, SampledLogprobs, SchedulerInbox,
                                         StepResult)
from pagewire.wire.to_supervisor import Fatal, Ready, SupervisorInbox
from pagewire.wire.to_tokenizer import ChatMessage, TokenizeRequest, TokenizerInbox

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234,
                          max_tokens=32, min_tokens=2, stop=["\n\n", "END"],
                          stop_token_ids=[2, 7], include_stop_str_in_output=True)

# (inbox union, message) for every message type an actor accepts.
CASES = [
    (TokenizerInbox, TokenizeRequest(req_id="cmpl-1", arrival_time=1700000000.25,
                                     sampling=SAMPLING, prompt="Héllo 日本語 🙂")),
    (TokenizerInbox, TokenizeRequest(req_id="chat-2", arrival_time=1.5, sampling=SamplingParams(),
                                     messages=[ChatMessage(role="system", content="Be brief."),
                                               ChatMessage(role="user", content="hi", name="bob")],
                                     add_generation_prompt=False, continue_final_message=True)),
    (TokenizerInbox, TokenizeRequest(req_id="ids-3", arrival_time=2.0,
                                     sampling=SamplingParams(temperature=0.0, max_tokens=None),
                                     prompt_token_ids=[1, 2, 3, 49151])),
    (SchedulerInbox, NewRequest(req_id="cmpl-1", prompt_token_ids=[1, 520, 33, 7],
                                sampling=SAMPLING, arrival_time=1700000000.25)),
    (SchedulerInbox, NewRequest(req_id="cmpl-2", prompt_token_ids=[1, 2],
                                sampling=SamplingParams(n=2, best_of=3, logprobs=0),
                                arrival_time=3.0, cache_salt="tenant-7", priority=-2)),
    (SchedulerInbox, Abort([SeqId("cmpl-1"), SeqId("chat-2", 1)])),
    (SchedulerInbox, StepResult(step_id=41, seq_ids=[SeqId("a"), SeqId("b", PROMPT)], token_ids=[17, 0])),
    (SchedulerInbox, StepResult(step_id=43, seq_ids=[SeqId("a"), beam("b", 1)], token_ids=[17, 4],
                                logprobs=SampledLogprobs([-0.25, 0.0], [[], [4, 9]],
                                                         [[], [-0.5, -1.5]]))),
    (SchedulerInbox, StepResult(step_id=42, seq_ids=[], token_ids=[], error="CUDA OOM")),
    (ExecutorInbox, StepPlan(
        step_id=7,
        new=[NewSeq(seq_id=SeqId("a"), token_ids=[1, 2, 3, 4, 5], num_prompt_tokens=4, num_computed=2,
                    num_scheduled=3, block_ids=[9, 3], sampling=SAMPLING)],
        running=[RunSeq(seq_id=SeqId("b"), num_scheduled=1, block_offset=3, block_ids=[]),
                 RunSeq(seq_id=SeqId("c", 2), num_scheduled=8, block_offset=1, block_ids=[11, 5],
                        new_token_ids=[77])],
        finished=[SeqId("d"), beam("e", 0)], copies=[[4, 12]], swap_out=[[6, 0], [7, 1]], swap_in=[[2, 8]])),
    (DetokenizerInbox, DetokStart(req_id="a", prompt_tail=[5, 6, 7, 8, 9, 10],
                                  num_prompt_tokens=120, stop=["###"],
                                  include_stop_str_in_output=True, skip_special_tokens=False,
                                  min_tokens=3)),
    (DetokenizerInbox, TokenDeltas([TokenDelta(SeqId("a"), [17, 18]),
                                    TokenDelta(SeqId("b"), [2], "stop"),
                                    TokenDelta(SeqId("c"), [], "error", "executor died"),
                                    TokenDelta(SeqId("d", 1), [4], "length", None, -3.5)])),
    (GatewayInbox, TextDeltas([TextDelta(SeqId("a"), "Héllo 🙂", 5, 2),
                               TextDelta(SeqId("b", 3), "", 9, 16, "length"),
                               TextDelta(SeqId("c"), "", 9, 0, "error", "boom")])),
    (GatewayInbox, RequestFailed(req_id="a", status=400, message="too long", param="prompt")),
    (GatewayInbox, RequestFailed(req_id="b", status=503, message="overloaded",
                                 error_type="ServiceUnavailableError")),
    (GatewayInbox, SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.375,
                                  prompt_tokens=1200, generation_tokens=345, preemptions=2,
                                  prefix_cache_queries=1200, prefix_cache_hits=64,
                                  inbox_messages={"NewRequest": 4, "StepResult": 90},
                                  iteration_tokens=[512, 3, 3], queue_times=[0.012],
                                  step_durations=[0.031, 0.0042, 0.0041])),
    (GatewayInbox, SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                  prompt_tokens=0, generation_tokens=0, preemptions=0,
                                  prefix_cache_queries=0, prefix_cache_hits=0)),
    (GatewayInbox, EngineReady("cpu-avx2")),
    (SupervisorInbox, Ready("executor 0", 4242)),
    (SupervisorInbox, Fatal("scheduler", "Traceback ...")),
]
INBOXES = [TokenizerInbox, SchedulerInbox, ExecutorInbox, DetokenizerInbox, GatewayInbox,
           SupervisorInbox]


@pytest.mark.parametrize("inbox,msg", CASES, ids=lambda x: type(x).__name__)
def test_message_round_trips_equal_and_same_type(inbox, msg):
    decoded = make_decoder(inbox).decode(encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_nested_structs_keep_their_types():
    plan_msg = next(m for _, m in CASES if isinstance(m, StepPlan))
    deltas_msg = next(m for _, m in CASES if isinstance(m, TokenDeltas))
    plan = make_decoder(ExecutorInbox).decode(encode(plan_msg))
    assert type(plan.new[0]) is NewSeq and type(plan.new[0].sampling) is SamplingParams
    assert all(type(r) is RunSeq for r in plan.running)
    assert plan.new[0].sampling.stop == ["\n\n", "END"] and plan.new[0].sampling.seed == 1234
    deltas = make_decoder(DetokenizerInbox).decode(encode(deltas_msg))
    assert [type(d) for d in deltas.deltas] == [TokenDelta] * len(deltas_msg.deltas)


@pytest.mark.parametrize("inbox", INBOXES, ids=lambda u: "|".join(
    t.__name__ for t in getattr(u, "__args__", (u,))))
def test_inbox_refuses_other_actors_messages(inbox):
    accepted = set(getattr(inbox, "__args__", (inbox,)))
    foreign = [msg for other, msg in CASES if type(msg) not in accepted]
    assert foreign
    decoder = make_decoder(inbox)
    for msg in foreign:
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(encode(msg))


@pytest.mark.parametrize("inbox", INBOXES)
@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x81\xa4type", b"\xde\xff",
                                     b"\x82\xa4typ"])
def test_inbox_refuses_garbage_bytes(inbox, garbage):
    with pytest.raises(msgspec.DecodeError) as info:
        make_decoder(inbox).decode(garbage)
    assert not isinstance(info.value, msgspec.ValidationError)   # malformed, not mistyped


def test_decoded_sampling_params_are_validated():
    frame = msgspec.msgpack.encode({"type": "NewRequest", "req_id": "x", "prompt_token_ids": [1],
                                    "sampling": {"top_p": 0.0}, "arrival_time": 0.0})
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        make_decoder(SchedulerInbox).decode(frame)


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -0.01}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"logprobs": -1}, "logprobs"),
    ({"n": 0}, "n"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
])
def test_invalid_sampling_value_names_the_param(kwargs, param):
    with pytest.raises(InvalidParam) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"min_p": 0.0},
    {"min_p": 1.0}, {"max_tokens": 1}, {"max_tokens": None, "min_tokens": 1000},
    {"min_tokens": 8, "max_tokens": 8}, {"seed": 0}, {"seed": 2**63 - 1},
])
def test_boundary_sampling_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_str_stop_is_normalized_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams().stop == []


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy


def test_default_sampling_params_encode_compactly():
    # omit_defaults: an empty map (msgspec writes a map16 header for structs this wide)
    assert encode(SamplingParams()) in (b"\x80", b"\xde\x00\x00")


def test_wire_imports_no_torch():
    code = ("import sys, pagewire.wire, pagewire.wire.channels, pagewire.wire.sampling_params, "
            "pagewire.wire.to_detokenizer, pagewire.wire.to_executor, pagewire.wire.to_gateway, "
            "pagewire.wire.to_scheduler, pagewire.wire.to_supervisor, pagewire.wire.to_tokenizer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
