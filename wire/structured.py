"""StructuredOutputsParams: a constraint on what a request may generate, as vLLM spells it.

Exactly one of json (a JSON schema), regex, choice, grammar (Lark or GBNF/EBNF) and
json_object is set. Construction checks the shape and the size caps; whether the schema,
regex or grammar is valid is the grammar compiler's call (actors/grammar_compiler.py, in the
tokenizer actor), which also fills `compiled`: the grammar the executor's matcher runs. A
client never sets `compiled`; the tokenizer overwrites it.
"""
from __future__ import annotations

import msgspec

MAX_CHOICES = 1024                    # entries of `choice`
MAX_CONSTRAINT_CHARS = 256 * 1024     # a schema (as JSON), regex or grammar, in characters
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class InvalidConstraint(ValueError):
    """A constraint that cannot be compiled: shape, size, or the compiler's own message."""


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: str | dict | None = None          # a JSON schema, as an object or its text
    regex: str | None = None
    choice: list[str] | None = None         # the output is exactly one of these strings
    grammar: str | None = None              # Lark, or GBNF / EBNF (llama.cpp's `root ::= ...`)
    json_object: bool | None = None         # any JSON object
    disable_any_whitespace: bool = False    # JSON without whitespace between tokens
    disable_additional_properties: bool = False   # objects hold only the properties named
    whitespace_pattern: str | None = None   # a regex for the whitespace JSON may hold
    compiled: str | None = None             # set by the tokenizer actor (see the module doc)
    start_after: list[int] | None = None    # set by it too: the constraint applies after these
                                            # tokens (a reasoning block's end) when it is set

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidConstraint(
                f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(set_kinds) or 'none'}")
        if self.choice is not None:
            if not self.choice:
                raise InvalidConstraint("choice must list at least one string")
            if len(self.choice) > MAX_CHOICES:
                raise InvalidConstraint(f"choice may list at most {MAX_CHOICES} strings, got "
                                        f"{len(self.choice)}")
        size = self.size()
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidConstraint(f"the {self.kind} constraint is {size} characters; at most "
                                    f"{MAX_CONSTRAINT_CHARS} are accepted")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def size(self) -> int:
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return len(value)
        if isinstance(value, bool):
            return 0
        return len(msgspec.json.encode(value))

    def digest_key(self) -> bytes:
        """What determines the compiled grammar (everything the tokenizer does not set)."""
        return msgspec.json.encode(msgspec.structs.replace(self, compiled=None,
                                                           start_after=None))
