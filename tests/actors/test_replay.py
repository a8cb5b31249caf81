"""`pagewire replay` refuses, with a reason, a trace that cannot be replayed."""
from __future__ import annotations

from pagewire.replay import differing_ids, replay
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


def test_divergence_names_only_the_requests_that_differ():
    a = StepResult(3, ["x", "y", "z"], [5, 6, 7])
    assert differing_ids(a, StepResult(3, ["x", "y", "z"], [5, 9, 7])) == ["y"]
    deltas = TokenDeltas([TokenDelta("x", [1]), TokenDelta("y", [2])])
    assert differing_ids(deltas, TokenDeltas([TokenDelta("x", [1])])) == ["y"]
    assert differing_ids(a, None) == ["x", "y", "z"]
