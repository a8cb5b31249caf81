"""Grammars for structured outputs: a constraint (wire/structured.py) compiled and checked in
the tokenizer actor, then matched token by token in the executor (executor/grammar_matchers.py).

The library is llguidance: it has no Python dependencies (xgrammar imports torch, which the
tokenizer actor never loads), never raises on a bad grammar or a refused token (the matcher
enters an error state we read), fills token bitmasks in parallel with the GIL released, rolls
back, and takes JSON schemas, regexes, Lark and GBNF grammars. A constraint compiles to
llguidance's grammar text; validating it against the model's tokenizer builds the lexer and
parser once, so a schema with an unsupported keyword (named in the message), a bad regex or
a grammar with an unknown rule is refused before anything is scheduled.
"""
from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import json
import threading
from collections import OrderedDict

import llguidance

from pagewire.wire.structured import InvalidConstraint, StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0     # a constraint not compiled by then is refused
_CACHE_ENTRIES = 512         # compiled grammars (and refusals) kept, by digest
_LABELS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
           "choice": "choice", "grammar": "grammar"}


def llg_tokenizer(hf_tokenizer, vocab_size: int, eos_ids) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary, allowing the EOS ids exactly where the
    grammar accepts. Its bitmasks span the wider of the logits (a model may pad its
    vocabulary) and the tokenizer (a model may be narrower: tokens past the logits' width are
    cut off when the masks are applied)."""
    import llguidance.hf    # imports transformers: the executor pays for it only when it must
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)),
                                        eos_token=list(eos_ids))


def grammar_text(so: StructuredOutputsParams) -> str:
    """The constraint as llguidance grammar text (not yet checked)."""
    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            options = {"whitespace_flexible": not so.disable_any_whitespace}
            if so.whitespace_pattern is not None:
                options["whitespace_pattern"] = so.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(_schema(so), overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", so.choice)
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise InvalidConstraint(f"invalid {_LABELS[kind]}: {e}") from None


def _schema(so: StructuredOutputsParams) -> dict:
    if so.json_object:
        return {"type": "object"}
    schema = so.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidConstraint(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidConstraint("a JSON schema must be an object")
    if so.disable_additional_properties:
        schema = _closed(copy.deepcopy(schema))
    return schema


# Where a schema holds subschemas (draft 2020-12 and the older `definitions`, `items` lists):
# only these are walked, so a value (enum, const, default) or a property that happens to be
# named "properties" is never taken for a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONES = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
                "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")


def _closed(node):
    """The schema with additionalProperties: false on every object schema that names its
    properties and says nothing of others (vLLM's disable_additional_properties; OpenAI's
    strict tools). An object schema naming no properties stays open: it asks for any."""
    if not isinstance(node, dict):
        return node
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _closed(sub)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for sub in node[key]:
                _closed(sub)
    for key in _SCHEMA_ONES:
        _closed(node.get(key))
    return node


def find(tokens: list[int], needle: list[int]) -> int:
    """Where `needle` first occurs in `tokens`, or -1 (a reasoning block's end in a prompt or
    an output)."""
    n = len(needle)
    for i in range(len(tokens) - n + 1):
        if tokens[i:i + n] == needle:
            return i
    return -1


class GrammarCompiler:
    """Compiles constraints on a small thread pool (llguidance releases the GIL), so a slow
    one delays only its own request; results and refusals are cached by digest. The
    llguidance tokenizer is built on first use (about half a second for a 49k vocabulary)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids):
        self._tokenizer_args = (hf_tokenizer, vocab_size, tuple(eos_ids))
        self._llg_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, concurrent.futures.Future] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")

    def submit(self, so: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the llguidance grammar text, or of InvalidConstraint."""
        key = hashlib.sha256(so.digest_key()).digest()
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._pool.submit(self._compile, so)
            if len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return future

    def compile(self, so: StructuredOutputsParams, timeout: float = COMPILE_TIMEOUT_S) -> str:
        """The grammar text; raises InvalidConstraint (a bad constraint, or too slow)."""
        return result_of(self.submit(so), so, timeout)

    def _compile(self, so: StructuredOutputsParams) -> str:
        text = grammar_text(so)
        error = llguidance.LLMatcher.validate_grammar(text, self.llg_tokenizer())
        if error:
            raise InvalidConstraint(f"invalid {_LABELS[so.kind]}: {error.strip()}")
        return text

    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llg_tokenizer(*self._tokenizer_args)
            return self._llg_tokenizer


def result_of(future: concurrent.futures.Future, so: StructuredOutputsParams,
              timeout: float = 0.0) -> str:
    """A compile's grammar text; raises InvalidConstraint, also when it is not done within
    `timeout` seconds (the compile itself runs on; llguidance's fuel limits bound it)."""
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise InvalidConstraint(f"compiling the {_LABELS[so.kind]} took longer than "
                                f"{COMPILE_TIMEOUT_S:g} s") from None
