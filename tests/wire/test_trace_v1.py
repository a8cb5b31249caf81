"""Traces of format 1 (StepResult flat) read back as format-2 messages (StepResult in
sections), so recordings made before still replay."""
from __future__ import annotations

import time

import msgspec
import pytest

from pagewire.wire import SamplingParams
from pagewire.wire.ids import SeqId
from pagewire.wire.replay import decode
from pagewire.wire.sampling_params import LogprobsChunk
from pagewire.wire.to_scheduler import (CompressResult, DraftsResult, NewRequest,
                                        PromptLogprobsResult, SampledLogprobs, StepResult,
                                        TierResult)
from pagewire.wire.trace import TraceHeader, TraceWriter, read_trace, set_recording


class OldStepResult(msgspec.Struct, tag="StepResult", gc=False):
    """StepResult exactly as format 1 wrote it (frozen here, independent of trace_v1.py)."""
    step_id: int
    seq_ids: list[SeqId]
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: dict[SeqId, LogprobsChunk] | None = None
    error: str | None = None
    errors: dict[SeqId, str] | None = None
    extra_token_ids: dict[SeqId, list[int]] | None = None
    extra_logprobs: dict[SeqId, LogprobsChunk] | None = None
    num_drafts: dict[SeqId, int] | None = None
    kv_loaded: dict[SeqId, int] | None = None
    head_lens: dict[SeqId, list[int]] | None = None


A, B = SeqId("a"), SeqId("b", 1)
PROMPT_CHUNK = LogprobsChunk([5, 6], [-1.0, -2.0], [[5], [7]], [[-1.0], [-0.5]])
EXTRA_CHUNK = LogprobsChunk([9], [-0.25], [[9]], [[-0.25]])

CASES = [
    (OldStepResult(1, [A], [4]), StepResult(1, [A], [4])),
    (OldStepResult(2, [], [], error="boom", kv_loaded={A: 3}),
     StepResult(2, [], [], error="boom", tier=TierResult({A: 3}))),
    (OldStepResult(3, [A, B], [4, 8], logprobs=[-0.5, 0.0], top_ids=[[4, 1], []],
                   top_logprobs=[[-0.5, -2.0], []], prompt_logprobs={A: PROMPT_CHUNK},
                   errors={B: "grammar"}, extra_token_ids={A: [9]},
                   extra_logprobs={A: EXTRA_CHUNK}, num_drafts={A: 2, B: 1},
                   kv_loaded={B: 0}, head_lens={A: [16, 12]}),
     StepResult(3, [A, B], [4, 8], errors={B: "grammar"},
                logprobs=SampledLogprobs([-0.5, 0.0], [[4, 1], []], [[-0.5, -2.0], []]),
                prompt_logprobs=PromptLogprobsResult({A: PROMPT_CHUNK}),
                drafts=DraftsResult({A: [9]}, {A: EXTRA_CHUNK}, {A: 2, B: 1}),
                tier=TierResult({B: 0}), compress=CompressResult({A: [16, 12]}))),
    # a drafts section holds every map, empty where the old field was None
    (OldStepResult(4, [A], [4], num_drafts={A: 3}),
     StepResult(4, [A], [4], drafts=DraftsResult({}, {}, {A: 3}))),
    (OldStepResult(5, [A], [4], extra_token_ids={A: [9, 10]}),
     StepResult(5, [A], [4], drafts=DraftsResult({A: [9, 10]}, {}, {}))),
]


@pytest.mark.parametrize("old, new", CASES, ids=[str(old.step_id) for old, _ in CASES])
def test_a_format_1_step_result_decodes_to_its_sections(old, new):
    frame = msgspec.msgpack.encode(old)
    assert decode("scheduler", frame, version=1) == new
    # the format-2 frame of the same result decodes as itself
    assert decode("scheduler", msgspec.msgpack.encode(new)) == new


def test_a_format_1_trace_file_reads_back_as_format_2_messages(tmp_path):
    d = str(tmp_path)
    set_recording(d, True)
    w = TraceWriter(d, TraceHeader(version=1, actor="scheduler", pid=7, segment=0,
                                   config_digest="c", model_id="m", config_json="{}",
                                   started=time.time()))
    request = NewRequest(req_id="r1", prompt_token_ids=[1, 2], arrival_time=1.0,
                         sampling=SamplingParams(max_tokens=2))
    for msg in (request, CASES[2][0]):
        w.record_message("in", "scheduler", msg, msgspec.msgpack.encode(msg))
    w.close()
    (path,) = tmp_path.glob("*.pwtrace")
    header, records = read_trace(str(path))
    assert header.version == 1
    assert [decode(r.channel, r.frame, header.version) for r in records] == [request, CASES[2][1]]


def test_an_unknown_format_is_refused(tmp_path):
    d = str(tmp_path)
    set_recording(d, True)
    TraceWriter(d, TraceHeader(version=99, actor="scheduler", pid=7, segment=0,
                               config_digest="c", model_id="m", config_json="{}")).close()
    (path,) = tmp_path.glob("*.pwtrace")
    with pytest.raises(ValueError, match="trace format 99, this reader knows 1, 2"):
        read_trace(str(path))
