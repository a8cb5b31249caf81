"""`pagewire replay` refuses, with a reason, a trace that cannot be replayed."""
from __future__ import annotations

from pagewire.replay import differing_ids, replay
from pagewire.wire.ids import PROMPT, SeqId
from pagewire.wire.to_detokenizer import TokenDelta, TokenDeltas
from pagewire.wire.to_scheduler import StepResult
from tests.wire.test_trace import new_request, record, writer


def test_redacted_trace_is_refused(tmp_path, capsys):
    w = writer(str(tmp_path), redacted=True)
    record(w, new_request(0))
    w.close()
    assert replay(str(tmp_path), "scheduler") == 2
    assert "--trace-redact" in capsys.readouterr().out


def test_rotated_away_start_is_refused(tmp_path, capsys):
    w = writer(str(tmp_path), segment_bytes=600, max_segments=2)
    for i in range(30):
        record(w, new_request(i))
    w.close()
    assert replay(str(tmp_path), "scheduler") == 2
    assert "rotated away" in capsys.readouterr().out


def test_missing_actor_is_refused(tmp_path, capsys):
    w = writer(str(tmp_path), actor="detokenizer")
    w.close()
    assert replay(str(tmp_path), "scheduler") == 2
    assert "no trace of a scheduler" in capsys.readouterr().out


def test_divergence_names_only_the_sequences_that_differ():
    x, y, z = SeqId("x"), SeqId("y", 1), SeqId("z", PROMPT)
    a = StepResult(3, [x, y, z], [5, 6, 7])
    assert differing_ids(a, StepResult(3, [x, y, z], [5, 9, 7])) == [y]
    deltas = TokenDeltas([TokenDelta(x, [1]), TokenDelta(y, [2])])
    assert differing_ids(deltas, TokenDeltas([TokenDelta(x, [1])])) == [y]
    assert differing_ids(a, None) == ["x", "y", "z"]      # whole requests, by id


def test_every_tokenizer_is_replayed_and_a_changed_reply_is_found(tmp_path, capsys):
    """With two tokenizers each has its own trace; both replay, and the one whose recorded
    reply differs from what a fresh tokenizer says is named."""
    import msgspec

    from pagewire.config import EngineConfig
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.process import open_tracer
    from pagewire.tokenizer import RequestTokenizer
    from pagewire.wire.channels import encode
    from pagewire.wire.to_tokenizer import TokenizeOnly
    from pagewire.wire.trace import set_recording

    config = EngineConfig.from_options(max_model_len=512, kv_cache_memory=64 * 2**20,
                          trace_dir=str(tmp_path)).resolve()
    tokenizer = RequestTokenizer(config, load_tokenizer(config.model.model_info))
    set_recording(str(tmp_path), True)
    for index, prompt in enumerate(["Hello there", "The capital of France"]):
        tracer = open_tracer(config, f"tokenizer {index}")
        ask = TokenizeOnly(req_id=f"t{index}", prompt=prompt)
        reply = tokenizer.tokenize_only(ask)
        if index == 1:
            reply = msgspec.structs.replace(reply, token_ids=reply.token_ids[:-1])
        tracer.record_message("in", f"tokenizer-{index}", ask, encode(ask))
        tracer.record_message("out", "gateway", reply, encode(reply))
        tracer.close()
    assert replay(str(tmp_path), "tokenizer") == 1
    out = capsys.readouterr().out
    assert "replayed 2 records of the tokenizer (tokenizer 0," in out
    assert "tokenizer 1 (pid" in out and "sequences or requests [t1]" in out
