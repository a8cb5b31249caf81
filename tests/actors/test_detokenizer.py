"""Detokenizer: incremental text without split characters, stop strings (cut, hold-back,
min_tokens, abort bookkeeping), and deltas that arrive before their DetokStart."""
from __future__ import annotations

import pytest

from pagewire.detokenizer import Detokenizer
from pagewire.wire.ids import SeqId
from pagewire.wire.to_detokenizer import DetokStart, TokenDelta, TokenDeltas

PROMPT_TAIL = [504, 3458, 28, 260, 1345, 30]


@pytest.fixture(scope="module")
def tokenizer():
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model
    return load_tokenizer(resolve_model(None))


@pytest.fixture
def detok(tokenizer):
    d = Detokenizer(tokenizer)
    yield d
    assert not d.live and not d.early and not d.stopped, "state left behind"


def _start(req_id="a", num_prompt_tokens=11, **kw) -> DetokStart:
    return DetokStart(req_id=req_id, prompt_tail=PROMPT_TAIL, num_prompt_tokens=num_prompt_tokens,
                      **kw)


def _feed(detok, ids, req_id="a", per_delta=1, final="length"):
    """Feed ids per_delta at a time (the last delta carrying `final`); return every TextDelta
    and every abort list, stopping at the first finished delta."""
    texts, aborts = [], []
    for i in range(0, len(ids), per_delta):
        last = i + per_delta >= len(ids)
        out, ab = detok.on_deltas(TokenDeltas([TokenDelta(SeqId(req_id), ids[i:i + per_delta],
                                                          final if last else None)]))
        texts += out
        aborts += ab
        if out and out[-1].finish_reason:
            break
    return texts, aborts


@pytest.mark.parametrize("text", ["Héllo wörld 日本語 🙂 ok", "naïve café — “quotes” 𝔘𝔫𝔦 ✓",
                                  "emoji 👩‍👩‍👧 family, flags 🇯🇵 and 中文字符"])
@pytest.mark.parametrize("per_delta", [1, 3])
def test_streamed_text_never_splits_characters_and_equals_decode(detok, tokenizer, text,
                                                                 per_delta):
    ids = tokenizer.encode(text)
    assert detok.start(_start()) == ([], [])
    texts, aborts = _feed(detok, ids, per_delta=per_delta)
    assert aborts == []
    assert all("\ufffd" not in t.text for t in texts)
    assert "".join(t.text for t in texts) == tokenizer.decode(ids) == text
    assert [t.finish_reason for t in texts] == [None] * (len(texts) - 1) + ["length"]
    assert [t.num_output_tokens for t in texts] == [
        min(len(ids), (i + 1) * per_delta) for i in range(len(texts))]
    assert {t.num_prompt_tokens for t in texts} == {11}
    assert {t.seq_id for t in texts} == {SeqId("a")}


def test_multi_byte_token_split_gives_empty_deltas_until_complete(detok, tokenizer):
    ids = tokenizer.encode(" 日")
    assert len(ids) > 1                                      # byte-level pieces
    detok.start(_start())
    texts, _ = _feed(detok, ids)
    assert [t.text for t in texts] == [""] * (len(ids) - 1) + [" 日"]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_aborts_the_request(detok, tokenizer, include):
    ids = tokenizer.encode("Hello world. STOP here and more")
    detok.start(_start(stop=["STOP"], include_stop_str_in_output=include))
    texts, aborts = _feed(detok, ids)
    assert "".join(t.text for t in texts) == ("Hello world. STOP" if include else "Hello world. ")
    assert texts[-1].finish_reason == "stop" and aborts == [SeqId("a")]
    assert texts[-1].num_output_tokens == len(tokenizer.encode("Hello world. STOP"))
    assert detok.stopped == {SeqId("a")} and SeqId("a") not in detok.live
    # What the scheduler sent before it saw the Abort is dropped, then its "abort" confirms.
    assert detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [1535, 323])])) == ([], [])
    assert SeqId("a") not in detok.early
    assert detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "abort")])) == ([], [])
    assert detok.stopped == set()


def test_stop_string_inside_a_token_cuts_mid_token(detok, tokenizer):
    detok.start(_start(stop=["orl", "zzz"]))
    texts, aborts = _feed(detok, tokenizer.encode("Hello world again"))
    assert "".join(t.text for t in texts) == "Hello w" and aborts == [SeqId("a")]
    detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "abort")]))


def test_earliest_of_several_stop_strings_wins(detok, tokenizer):
    detok.start(_start(stop=["again", "world", "\n\n"]))
    texts, _ = _feed(detok, tokenizer.encode("Hello\n\nworld again"))
    assert "".join(t.text for t in texts) == "Hello"
    detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "abort")]))


def test_stop_on_the_final_delta_does_not_ask_for_an_abort(detok, tokenizer):
    ids = tokenizer.encode("one two STOP")
    detok.start(_start(stop=["STOP"]))
    out, aborts = detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), ids, "length")]))
    assert [(t.text, t.finish_reason) for t in out] == [("one two ", "stop")]
    assert aborts == [] and not detok.stopped


def test_possible_stop_prefix_is_held_back_then_released(detok, tokenizer):
    stop = "world!"
    text = "Hello world, hello wor world! Bye"
    ids = tokenizer.encode(text)
    detok.start(_start(stop=[stop]))
    sent = ""
    for i, tid in enumerate(ids):
        out, aborts = detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [tid])]))
        sent += "".join(t.text for t in out)
        if out[-1].finish_reason:
            break
        full = tokenizer.decode(ids[:i + 1])
        held = full[len(sent):]
        assert full.startswith(sent)
        # Every tail of the text that could still begin the stop string is held back ...
        could_start = max((k for k in range(1, len(stop)) if full.endswith(stop[:k])), default=0)
        assert len(held) >= could_start, (full, sent)
        # ... and no more than len(stop) - 1 characters are ever held.
        assert len(held) <= len(stop) - 1, (full, sent)
    assert sent == "Hello world, hello wor " and aborts == [SeqId("a")]
    detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "abort")]))


def test_held_back_text_is_released_when_the_request_ends(detok, tokenizer):
    detok.start(_start(stop=["a long stop string"]))
    texts, aborts = _feed(detok, tokenizer.encode("short answer"))
    assert [t.text for t in texts][:-1] == [""] * (len(texts) - 1)   # all held back
    assert texts[-1].text == "short answer" and texts[-1].finish_reason == "length"
    assert aborts == []


def test_stop_strings_are_ignored_within_min_tokens(detok, tokenizer):
    ids = tokenizer.encode("STOP one two three four STOP five")   # first STOP is output 1
    detok.start(_start(stop=["STOP"], min_tokens=4))
    texts, aborts = _feed(detok, ids)
    assert "".join(t.text for t in texts) == "STOP one two three four "
    assert texts[-1].finish_reason == "stop" and aborts == [SeqId("a")]
    detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "abort")]))


def test_stop_string_completed_by_the_first_counted_output_stops(detok, tokenizer):
    ids = tokenizer.encode("one STOP two")                   # ['one', ' ST', 'OP', ' two']
    detok.start(_start(stop=["STOP"], min_tokens=2))         # 'OP' is output 3
    texts, aborts = _feed(detok, ids)
    assert "".join(t.text for t in texts) == "one " and aborts == [SeqId("a")]
    detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "abort")]))


def test_stop_string_completed_within_min_tokens_stays_ignored(detok, tokenizer):
    ids = tokenizer.encode("STOP one STOP two")             # ['STOP', ' one', ' ST', 'OP', ...]
    detok.start(_start(stop=["STOP"], min_tokens=1))
    texts, aborts = _feed(detok, ids)
    detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "abort")]))
    assert "".join(t.text for t in texts) == "STOP one "
    assert texts[-1].num_output_tokens == 4


def test_deltas_before_detok_start_are_buffered_and_replayed(detok, tokenizer):
    ids = tokenizer.encode("early bird 🙂")
    first, rest = ids[:2], ids[2:]
    assert detok.on_deltas(TokenDeltas([TokenDelta(SeqId("b"), first)])) == ([], [])
    assert detok.on_deltas(TokenDeltas([TokenDelta(SeqId("b"), rest, "length")])) == ([], [])
    assert [d.token_ids for d in detok.early[SeqId("b")]] == [first, rest]
    texts, aborts = detok.start(_start("b", num_prompt_tokens=5))
    assert "".join(t.text for t in texts) == "early bird 🙂" and aborts == []
    assert [(t.num_output_tokens, t.finish_reason) for t in texts] == [(2, None),
                                                                      (len(ids), "length")]
    assert {t.num_prompt_tokens for t in texts} == {5}


def test_detok_start_overtaken_by_its_abort_is_dropped(detok):
    """The scheduler aborted the request before the DetokStart arrived (different sockets)."""
    assert detok.on_deltas(TokenDeltas([TokenDelta(SeqId("late"), [], "abort")])) == ([], [])
    assert detok.start(_start("late")) == ([], [])
    assert "late" not in detok.live


def test_early_abort_discards_buffered_deltas(detok):
    detok.on_deltas(TokenDeltas([TokenDelta(SeqId("c"), [5, 6])]))
    assert detok.on_deltas(TokenDeltas([TokenDelta(SeqId("c"), [], "abort")])) == ([], [])
    assert "c" not in detok.early


def test_interleaved_requests_keep_separate_state(detok, tokenizer):
    a, b = tokenizer.encode("alpha beta"), tokenizer.encode("日本 gamma")
    detok.start(_start("a", num_prompt_tokens=3))
    detok.start(_start("b", num_prompt_tokens=4))
    got = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):
        deltas = [TokenDelta(SeqId(r), ids[i:i + 1], "length" if i == len(ids) - 1 else None)
                  for r, ids in (("a", a), ("b", b)) if i < len(ids)]
        out, _ = detok.on_deltas(TokenDeltas(deltas))
        for t in out:
            got[t.seq_id.req] += t.text
            assert t.num_prompt_tokens == {"a": 3, "b": 4}[t.seq_id.req]
    assert got == {"a": "alpha beta", "b": "日本 gamma"}


def test_error_delta_finishes_with_its_message(detok, tokenizer):
    detok.start(_start())
    out, aborts = detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), [], "error", "executor died")]))
    assert [(t.text, t.finish_reason, t.error, t.num_output_tokens) for t in out] == [
        ("", "error", "executor died", 0)]
    assert aborts == []


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(detok, tokenizer, skip):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("done") + [eos]
    detok.start(_start(skip_special_tokens=skip))
    texts, _ = _feed(detok, ids)
    expected = "done" if skip else "done" + tokenizer.convert_ids_to_tokens(eos)
    assert "".join(t.text for t in texts) == expected
