"""Structured outputs: the constraint's shape (wire/structured.py), its compile in the
tokenizer actor (actors/grammar_compiler.py), the executor's masks and matchers, and a fuzz run of a
random-weight model at temperature 1 whose every finished output must match its constraint."""
from __future__ import annotations

import concurrent.futures
import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from pagewire import InvalidConstraint, InvalidParam, SamplingParams
from pagewire import StructuredOutputsParams as S
from pagewire.config import EngineConfig
from pagewire.executor.sampler import apply_bitmasks
from pagewire.executor.seq_table import SeqState, SeqTable
from pagewire.gateway.tools import FunctionDef, NamedFunction, NamedToolChoice, Tool, plan_tools
from pagewire.grammar_compiler import grammar_text, result_of
from pagewire.tokenizer import RequestTokenizer
from pagewire.wire.structured import MAX_CHOICES, MAX_CONSTRAINT_CHARS
from pagewire.wire.to_gateway import RequestFailed
from pagewire.wire.to_scheduler import NewRequest
from pagewire.wire.to_tokenizer import TokenizeRequest
from tests.actors.sched_helpers import EOS, assert_pool_whole, make_scheduler, new, sid


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of json, regex, choice, grammar, "
                                      "json_object; got regex, choice"),
    ({"choice": []}, "choice must list at least one string"),
    ({"choice": ["x"] * (MAX_CHOICES + 1)}, f"at most {MAX_CHOICES} strings"),
    ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, f"at most {MAX_CONSTRAINT_CHARS}"),
])
def test_a_constraint_of_the_wrong_shape_is_refused(fields, message):
    with pytest.raises(InvalidConstraint, match=re.escape(message)):
        S(**fields)


@pytest.mark.parametrize("clash", [{"use_beam_search": True, "n": 2}, {"ignore_eos": True},
                                   {"min_tokens": 3}])
def test_what_would_fight_the_grammar_over_eos_is_refused(clash):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(structured_outputs=S(regex="a+"), **clash)
    assert e.value.param == next(iter(clash))


@pytest.fixture(scope="module")
def config():
    return EngineConfig.from_options(max_model_len=256).resolve()


@pytest.fixture(scope="module")
def rt(config):
    from pagewire.hf_tokenizer import load_tokenizer
    return RequestTokenizer(config, load_tokenizer(config.model.model_info), background=True)


@pytest.mark.parametrize("constraint, message", [
    (S(json='{"type": "objec'), "the JSON schema is not valid JSON"),
    (S(json={"type": "object", "not": {"type": "string"}}), 'Unimplemented keys: ["not"]'),
    (S(json={"$ref": "#/definitions/missing"}), "invalid JSON schema"),
    (S(regex="a(b"), "invalid regex"),
    (S(grammar="start: foo"), 'unknown name: "foo"'),
    (S(grammar='root ::= "a" | undefined-rule'), "invalid grammar"),
])
def test_a_bad_constraint_is_a_400_from_the_tokenizer(rt, constraint, message):
    req = TokenizeRequest(req_id="r", arrival_time=0.0, prompt="hi",
                          sampling=SamplingParams(structured_outputs=constraint))
    sends = rt.handle(req)
    while not sends:                                   # held while it compiles
        sends = rt.poll()
    [(channel, failed)] = sends
    assert channel == "gateway" and isinstance(failed, RequestFailed)
    assert failed.status == 400 and failed.param == "structured_outputs"
    assert message in failed.message and "<state>" not in failed.message


def test_a_compiled_grammar_goes_to_the_scheduler_and_is_cached(rt):
    so = S(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    req = TokenizeRequest(req_id="r", arrival_time=0.0, prompt="hi",
                          sampling=SamplingParams(structured_outputs=so))
    sends = rt.handle(req) or rt.grammars.submit(so).result() and rt.poll()
    assert [c for c, _ in sends] == ["detokenizer", "scheduler"]
    new_request = sends[1][1]
    assert isinstance(new_request, NewRequest)
    compiled = new_request.sampling.structured_outputs.compiled
    assert '"json_schema"' in compiled
    assert rt.grammars.submit(S(json=dict(so.json))) is rt.grammars.submit(so)   # by digest
    assert rt.handle(req)[1][1].sampling.structured_outputs.compiled == compiled  # at once


def test_a_compile_that_runs_out_of_time_is_refused():
    with pytest.raises(InvalidConstraint, match="took longer than"):
        result_of(concurrent.futures.Future(), S(regex="a"))


def test_a_bitmask_leaves_exactly_its_tokens():
    logits = torch.zeros(3, 70)
    masks = np.zeros((2, 3), dtype=np.int32)
    masks[0, 0] = 1 << 5                    # token 5
    masks[0, 2] = (1 << 3) | -(1 << 31)     # token 67; token 95 (the sign bit) is past V
    masks[1, 1] = -1                        # tokens 32..63
    apply_bitmasks(logits, [0, 2], masks)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5, 67]
    assert torch.isfinite(logits[1]).all()                       # an unconstrained row
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == list(range(32, 64))


class _Refusing:
    def consume_token(self, token):
        return token != 9

    def get_error(self):
        return "token 9 refused\n<state>long dump</state>"


def test_a_refused_token_fails_its_sequence_alone():
    table = SeqTable([EOS])
    a = SeqState([1, 2], 2, 2, [0], SamplingParams(), matcher=_Refusing())
    b = SeqState([1, 2], 2, 2, [1], SamplingParams(), matcher=_Refusing())
    errors = table.finish_step([], [(sid("a"), a, [9]), (sid("b"), b, [4])])
    assert errors == {sid("a"): "the output left its grammar: token 9 refused"}
    assert a.stopped and not b.stopped


def test_the_scheduler_ends_a_sequence_whose_grammar_failed_and_frees_its_blocks():
    sched = make_scheduler()
    sched.add(new("a", 4))
    sched.add(new("b", 4))
    plan = sched.schedule()
    result = sched.run(default=5)
    result.errors = {sid("a"): "the output left its grammar: x"}
    deltas = sched.update(plan, result)
    assert [(str(d.seq_id), d.token_ids, d.finish_reason, d.error) for d in deltas] == \
        [("a", [], "error", "the output left its grammar: x"), ("b", [5], None, None)]
    plan = sched.schedule()
    assert [str(s) for s in plan.finished] == ["a"]
    assert [str(r.seq_id) for r in plan.running] == ["b"]
    sched.abort(["b"])
    sched.update(plan, sched.run())
    sched.schedule()
    assert_pool_whole(sched)


# -- fuzz: every finished output of a random model at temperature 1 matches ------------------

def _schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["boolean", "enum", "integer", "string"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "é"], rng.randint(1, 3))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 4)}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "ok", "n"], rng.randint(1, 3))
        return {"type": "object", "properties": {k: _schema(rng, depth + 1) for k in names},
                "required": names, "additionalProperties": False}
    return {"type": kind}


def _regex(rng: random.Random) -> str:
    pieces = [r"[a-z]{1,3}", r"[0-9]{2}", r"(yes|no)", r"-", r"[A-F]?", r"(ab|c)+?x"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))


def _grammar(rng: random.Random) -> tuple[str, str]:
    """(a GBNF or Lark grammar, a Python regex of the same language)."""
    words = rng.sample(["cat", "dog", "fish", "bird"], 3)
    if rng.random() < 0.5:
        gbnf = (f'root ::= animal ("," animal)?\nanimal ::= "{words[0]}" | "{words[1]}" | '
                f'"{words[2]}"')
        animal = "|".join(words)
        return gbnf, f"({animal})(,({animal}))?"
    lark = f'start: "n=" NUM " " WORD\nNUM: /[0-9]{{1,2}}/\nWORD: "{words[0]}" | "{words[1]}"'
    return lark, rf"n=[0-9]{{1,2}} ({words[0]}|{words[1]})"


def _cases(seed: int = 7):
    rng = random.Random(seed)
    cases = []
    for _ in range(8):
        schema = _schema(rng)
        cases.append((S(json=schema, disable_any_whitespace=rng.random() < 0.7),
                      lambda text, s=schema: jsonschema.validate(json.loads(text), s)))
    for _ in range(6):
        regex = _regex(rng)
        cases.append((S(regex=regex), lambda text, r=regex: _fullmatch(r, text)))
    for _ in range(4):
        grammar, regex = _grammar(rng)
        cases.append((S(grammar=grammar), lambda text, r=regex: _fullmatch(r, text)))
    choices = ["alpha", "beta gamma", "δ"]
    cases.append((S(choice=choices), lambda text: _check(text in choices, text)))
    cases.append((S(json_object=True), lambda text: _check(isinstance(json.loads(text), dict),
                                                           text)))
    return cases


def _fullmatch(regex: str, text: str) -> None:
    _check(re.fullmatch(regex, text) is not None, f"{text!r} !~ {regex!r}")


def _check(ok: bool, what: str) -> None:
    assert ok, what


@pytest.fixture(scope="module")
def fuzz_llm(tmp_path_factory, smol_tokenizer_dir):
    from pagewire import LLM
    from tests.helpers import make_tiny_llama
    # As wide as its tokenizer: a grammar may force a token only a wide vocabulary holds.
    path = make_tiny_llama(str(tmp_path_factory.mktemp("fuzz") / "m"), smol_tokenizer_dir,
                           vocab_size=49152, seed=3)
    return LLM(path, dtype="float32", num_kv_blocks=512, block_size=16)


def test_fuzz_every_finished_output_matches_its_constraint(fuzz_llm):
    cases = _cases()
    params = [SamplingParams(temperature=1.0, n=2, max_tokens=48, structured_outputs=so)
              for so, _ in cases]
    outs = fuzz_llm.generate([[5 + i, 6, 7] for i in range(len(cases))], params)
    finished = 0
    for (so, check), out in zip(cases, outs):
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), (so, c)
            if c.finish_reason == "stop":
                check(c.text)
                finished += 1
    assert finished >= len(cases)            # most of the 2 x 20 outputs end by their grammar
    assert fuzz_llm.scheduler.kv.num_free == fuzz_llm.scheduler.kv.num_blocks


def test_constrained_greedy_outputs_survive_preemption_and_pipelining(fuzz_llm):
    from pagewire import LLM
    so = S(json={"type": "object", "properties": {"k": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 6}}, "required": ["k"]},
        disable_any_whitespace=True, disable_additional_properties=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    prompts = [[5 + i, 9, 9, 9, 9, 9, 9, 9] for i in range(6)]
    roomy = [o.outputs[0].token_ids for o in fuzz_llm.generate(prompts, params)]
    tight = LLM(fuzz_llm.config.model.model_info.path, dtype="float32", num_kv_blocks=16,
                max_model_len=48, block_size=4, max_num_seqs=6, async_scheduling=True)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == roomy
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert set(json.loads(out.outputs[0].text)) == {"k"}      # no other property


def _allowed(matchers, matcher) -> list[int]:
    masks = matchers.fill_async([matcher]).result()
    bits = np.unpackbits(masks.view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0].tolist()


def test_a_constraint_after_reasoning_starts_at_the_end_of_the_block(config, rt):
    from pagewire.executor.grammar_matchers import Matchers
    from pagewire.wire.to_executor import NewSeq, StepPlan
    info = config.model.model_info
    matchers = Matchers(info, info.vocab_size, info.eos_token_ids)
    so = S(choice=["yes"])
    so = S(choice=["yes"], compiled=rt.grammars.compile(so), start_after=[10, 11])
    table = SeqTable([EOS], matchers)
    params = SamplingParams(structured_outputs=so)
    [(_, seq)] = table.apply(StepPlan(0, [NewSeq(sid("a"), [1, 2, 3], 3, 0, 3, [0], params)],
                                      [], []))
    assert seq.matcher is None                          # reasoning: unconstrained
    for token in (10, 7, 10):
        table.finish_step([], [(sid("a"), seq, [token])])
        assert seq.matcher is None
    table.finish_step([], [(sid("a"), seq, [11])])        # the block's end: constrained now
    yes = rt.tokenizer.encode("yes", add_special_tokens=False)
    assert _allowed(matchers, seq.matcher) == yes[:1]
    # Back after preemption with its outputs: the matcher replays what followed the block.
    resumed = NewSeq(sid("b"), [1, 2, 3, 10, 11] + yes, 3, 0, 7, [0], params)
    [(_, again)] = table.apply(StepPlan(1, [resumed], [], []))
    assert _allowed(matchers, again.matcher) == list(info.eos_token_ids)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_jump_forward_drafts_what_the_grammar_forces_and_keeps_the_output(fuzz_llm, method):
    from pagewire import LLM
    schema = {"type": "object", "properties": {
        "a_rather_long_property_name": {"type": "integer", "minimum": 0, "maximum": 9},
        "another_quite_long_fixed_key": {"enum": ["first choice", "second choice"]}},
        "required": ["a_rather_long_property_name", "another_quite_long_fixed_key"],
        "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=S(
        json=schema, disable_any_whitespace=True))
    prompts = [[5 + i, 6, 7] for i in range(3)]
    plain = [o.outputs[0].token_ids for o in fuzz_llm.generate(prompts, params)]
    path = fuzz_llm.config.model.model_info.path
    draft = {"method": "draft_model", "model": path} if method == "draft_model" else {}
    spec = LLM(path, dtype="float32", num_kv_blocks=512, block_size=16,
               speculative_config={"num_speculative_tokens": 8, "max_batch": 8, **draft})
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    drafts = spec.scheduler.drafts
    assert drafts.num_accepted_tokens >= 3 * 8          # the keys came as forced drafts
    assert spec.scheduler.step_id < max(len(t) for t in plain)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}


def _accepts(rt, so: S, text: str) -> bool:
    """Whether the constraint's grammar takes `text` whole (llguidance's own matcher)."""
    import llguidance
    tokenizer = rt.grammars.llg_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(so))
    tokens = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and \
        matcher.consume_tokens(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("schema, text, closed, opened", [
    (WEATHER, '{"city": "Paris", "unit": "celsius"}', True, True),
    (WEATHER, '{"city": "Paris", "unit_low": 3}', False, True),       # a key it does not name
    ({**WEATHER, "additionalProperties": True}, '{"city": "Paris", "x": 1}', True, True),
    ({**WEATHER, "additionalProperties": {"type": "integer"}}, '{"city": "P", "x": 1}',
     True, True),
    ({"type": "object", "properties": {"at": {"type": "object", "properties": {
        "lat": {"type": "number"}}}}}, '{"at": {"lat": 1, "lon": 2}}', False, True),  # nested
    ({"type": "object", "properties": {"properties": {"type": "string"}}},   # a key so named
     '{"properties": "x"}', True, True),
    ({"enum": [{"properties": {"a": 1}}]}, '{"properties": {"a": 1}}', True, True),  # a value
    ({"type": "object"}, '{"anything": 1}', True, True),   # names no properties: stays open
])
def test_disable_additional_properties_closes_only_what_says_nothing(rt, schema, text, closed,
                                                                     opened):
    assert _accepts(rt, S(json=schema, disable_additional_properties=True), text) is closed
    assert _accepts(rt, S(json=schema), text) is opened


@pytest.mark.parametrize("text, taken", [
    ('{"city": "Paris", "unit": "celsius"}', True),
    ('{\n    "city": "Paris",\n    "unit": "celsius"\n}', True),         # pretty-printed
    ('{"city": "Paris",\n\n\n"unit": "celsius"}', False),        # blank lines: rambling
    ('{"city": "Paris", "country": "France"}', False),           # a key the schema does not name
])
def test_a_forced_calls_json_is_closed_and_its_whitespace_bounded(rt, text, taken):
    plan = plan_tools([Tool(function=FunctionDef(name="get_weather", parameters=WEATHER))],
                      NamedToolChoice(function=NamedFunction(name="get_weather")), True, None)
    [(_, fields)] = plan.constraint
    assert _accepts(rt, S(**fields), text) is taken
