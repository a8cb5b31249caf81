"""Trace files: what is recorded, redaction, rotation, the on/off switch, cut-short files."""
from __future__ import annotations

import os
import stat
import time
import warnings

import msgspec
import pytest

from pagewire.wire import SamplingParams
from pagewire.wire.channels import encode
from pagewire.wire.ids import SeqId
from pagewire.wire.to_gateway import TextDelta, TextDeltas, TokenLogprob
from pagewire.wire.to_scheduler import NewRequest, SchedulerInbox
from pagewire.wire.trace import (FORMAT_VERSION, TraceHeader, TraceWriter, read_trace,
                                 set_recording, trace_files)


def header(actor: str = "scheduler", redacted: bool = False) -> TraceHeader:
    return TraceHeader(version=FORMAT_VERSION, actor=actor, pid=4242, segment=0,
                       config_digest="c0ffee", model_id="tiny@abc", config_json="{}",
                       started=time.time(), redacted=redacted)


def new_request(i: int) -> NewRequest:
    return NewRequest(req_id=f"r{i}", prompt_token_ids=[11, 12, 13 + i],
                      sampling=SamplingParams(max_tokens=4, seed=i), arrival_time=1.0)


def writer(directory: str, **kw) -> TraceWriter:
    set_recording(directory, True)
    return TraceWriter(directory, header(**{k: kw.pop(k) for k in ("actor", "redacted") if k in kw}),
                       **kw)


def record(w: TraceWriter, msg, direction: str = "in", channel: str = "scheduler") -> None:
    w.record_message(direction, channel, msg, encode(msg))


def records_of(path: str) -> list:
    return list(read_trace(path)[1])


def trace_of_requests(directory: str, count: int) -> str:
    """A closed scheduler trace of `count` NewRequests; its path."""
    w = writer(directory)
    for i in range(count):
        record(w, new_request(i))
    w.close()
    (path,) = trace_files(directory)
    return path


def test_records_read_back_in_order_with_header(tmp_path):
    path = trace_of_requests(str(tmp_path), 5)
    assert os.path.basename(path) == "scheduler.4242.00000.pwtrace"
    head, records = read_trace(path)
    assert (head.actor, head.pid, head.config_digest, head.model_id) == \
        ("scheduler", 4242, "c0ffee", "tiny@abc")
    decoder = msgspec.msgpack.Decoder(SchedulerInbox)
    records = list(records)
    assert [decoder.decode(r.frame) for r in records] == [new_request(i) for i in range(5)]
    assert [(r.direction, r.channel) for r in records] == [("in", "scheduler")] * 5
    assert all(a.mono <= b.mono for a, b in zip(records, records[1:]))


def test_files_are_private(tmp_path):
    directory = str(tmp_path / "traces")
    w = writer(directory)
    record(w, new_request(0))
    w.close()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for name in os.listdir(directory):
        assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600


def test_redaction_keeps_counts_and_structure(tmp_path):
    w = writer(str(tmp_path), redacted=True)
    record(w, new_request(3))
    delta = TextDelta(SeqId("r3"), "Paris!", 3, 2, logprobs=[
        TokenLogprob(4521, "Paris", -0.1, [(4521, "Paris", -0.1), (77, "Lyon", -2.5)])])
    record(w, TextDeltas([delta]), channel="gateway")
    w.close()
    head, records = read_trace(trace_files(str(tmp_path))[0])
    assert head.redacted
    req = msgspec.msgpack.decode(next(records).frame, type=NewRequest)
    assert req.req_id == "r3" and req.prompt_token_ids == [0, 0, 0]
    assert req.sampling.max_tokens == 4 and req.sampling.seed == 3
    (text,) = msgspec.msgpack.decode(next(records).frame, type=TextDeltas).deltas
    assert text.text == "\u2588" * 6 and (text.num_prompt_tokens, text.num_output_tokens) == (3, 2)
    (lp,) = text.logprobs
    assert (lp.token_id, lp.token, lp.logprob) == (0, "\u2588" * 5, -0.1)
    assert lp.top == [(0, "\u2588" * 5, -0.1), (0, "\u2588" * 4, -2.5)]


def test_redaction_blanks_images():
    from pagewire.wire.multimodal import ImageInput
    from pagewire.wire.trace import redact
    image = ImageInput(b"digest", 3, 4, b"\x01\x02\x03\x04", [1, 1, 1])
    req = msgspec.structs.replace(new_request(3), images=[image])
    (blank,) = redact(req).images
    assert (blank.pixels, blank.digest, blank.offset, blank.length) == \
        (bytes(4), b"digest", 3, 4)


def test_rotation_keeps_the_newest_segments(tmp_path):
    w = writer(str(tmp_path), segment_bytes=600, max_segments=3)
    for i in range(60):
        record(w, new_request(i))
    w.close()
    paths = trace_files(str(tmp_path))
    segments = [read_trace(p)[0].segment for p in paths]
    assert len(paths) == 3 and segments == sorted(segments) and segments[-1] >= 5
    assert all(os.path.getsize(p) <= 600 for p in paths)
    last = records_of(paths[-1])
    decoder = msgspec.msgpack.Decoder(SchedulerInbox)
    assert decoder.decode(last[-1].frame).req_id == "r59"


def test_switched_off_records_nothing_and_resumes_in_a_new_segment(tmp_path):
    directory = str(tmp_path)
    w = writer(directory)
    record(w, new_request(0))
    set_recording(directory, False)
    w._checked = 0.0                   # the writer looks at the flag at most once a second
    record(w, new_request(1))
    set_recording(directory, True)
    w._checked = 0.0
    record(w, new_request(2))
    w.close()
    first, second = trace_files(directory)
    assert [r.frame for r in records_of(first)] == [encode(new_request(0))]
    assert read_trace(second)[0].gap and read_trace(second)[0].segment == 1
    assert [r.frame for r in records_of(second)] == [encode(new_request(2))]


@pytest.mark.parametrize("cut", [1, 7, 30])
def test_cut_short_file_reads_to_the_last_whole_record(tmp_path, cut):
    path = trace_of_requests(str(tmp_path), 4)
    with open(path, "r+b") as f:                 # killed mid-write: the last record is partial
        f.truncate(os.path.getsize(path) - cut)
    with pytest.warns(UserWarning, match="cut short or corrupt after record 3"):
        records = records_of(path)
    assert len(records) == 3


def test_corrupt_tail_reads_to_the_last_whole_record(tmp_path):
    path = trace_of_requests(str(tmp_path), 3)
    with open(path, "ab") as f:
        f.write(b"\x05\x00\x00\x00\xc1\xc1\xc1\xc1\xc1")      # a length, then bytes no record has
    with pytest.warns(UserWarning, match="after record 3"):
        assert len(records_of(path)) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 9)
        assert len(records_of(path)) == 3      # whole again: no warning


def test_not_a_trace(tmp_path):
    path = tmp_path / "x.pwtrace"
    path.write_bytes(b"hello")
    with pytest.raises(ValueError, match="not a pagewire trace"):
        read_trace(str(path))
