"""Where a request asks for structured outputs, as vLLM and OpenAI spell it: the
`structured_outputs` object, `response_format` json_object / json_schema, and vLLM's older
`guided_*` fields. At most one may be set; the result is the request's
StructuredOutputsParams (wire/structured.py), checked for shape here and compiled by the
tokenizer actor. Refusals raise InvalidParam naming the field (a 400 at the edge)."""
from __future__ import annotations

import msgspec

from pagewire.wire.sampling_params import InvalidParam
from pagewire.wire.structured import InvalidConstraint, StructuredOutputsParams


class StructuredOutputsBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams less `compiled`)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: dict | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class ConstraintFields(msgspec.Struct, kw_only=True):
    """The request fields that ask for a constraint (mixed into both endpoints' bodies)."""
    structured_outputs: StructuredOutputsBody | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


def requested_constraints(body: ConstraintFields) -> list[tuple[str, dict]]:
    """(the field that asked, StructuredOutputsParams fields) for each constraint asked."""
    asked = []
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", msgspec.structs.asdict(body.structured_outputs)))
    rf = body.response_format
    if rf is not None and rf.type != "text":
        asked.append(("response_format", _response_format(rf)))
    guided = {key: getattr(body, f"guided_{key}") for key in ("json", "regex", "choice",
                                                             "grammar")}
    guided = {k: v for k, v in guided.items() if v is not None}
    if guided:
        if body.guided_whitespace_pattern is not None:
            guided["whitespace_pattern"] = body.guided_whitespace_pattern
        asked.append((f"guided_{next(iter(guided))}", guided))
    return asked


def _response_format(rf: ResponseFormat) -> dict:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise InvalidParam("response_format",
                               "response_format json_schema needs json_schema.schema")
        return {"json": rf.json_schema.schema}
    raise InvalidParam("response_format", f"response_format type {rf.type!r} is not "
                       "supported (text, json_object, json_schema)")


def constraint(asked: list[tuple[str, dict]]) -> StructuredOutputsParams | None:
    """The one constraint asked for, or None; two at once is a 400."""
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidParam(asked[1][0], "only one output constraint may be set; got "
                           f"{', '.join(name for name, _ in asked)}")
    name, fields = asked[0]
    try:
        return StructuredOutputsParams(**fields)
    except InvalidConstraint as e:
        raise InvalidParam(name, str(e)) from None
