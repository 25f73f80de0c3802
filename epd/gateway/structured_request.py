"""Structured outputs as a client asks for them over HTTP (no HTTP in here): OpenAI's
`response_format`, vLLM's `structured_outputs` object and its older `guided_*` fields, read into
one `StructuredOutputs` (a JSON body, chat completions' and legacy completions' alike).

    response_format  {"type": "text"} (nothing), {"type": "json_object"} (any JSON object),
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}
    structured_outputs  {"json": schema, "json_object": true, "regex": "...", "choice": [...],
                     "grammar": "EBNF"} (one of them) and "disable_any_whitespace"
    guided_json / guided_regex / guided_choice / guided_grammar  vLLM's older names of the same

A request may ask in one of these ways only (400 naming the fields it sent). What this server does
not implement (vLLM's `structural_tag`, `whitespace_pattern`, ...) is refused here, by name; the
sizes by the pipeline's check before any media is encoded (`StructuredOutputs.validate`); what
xgrammar cannot compile by prefill, with the compiler's reason (the gateway needs no xgrammar).
"""

from __future__ import annotations

import json
from typing import Any

from epd.gateway.json_fields import boolean_field, checked_text, lax_value, shown_value
from epd.model_runtime.sampling import MAX_CHOICE_STRINGS, MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutputs
from epd.stages.errors import InvalidRequest

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
"""The request fields that ask for structured outputs."""

_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")
_OPTIONS = ("disable_any_whitespace", "disable_fallback")
_BOOL_OPTIONS = ("disable_additional_properties",)
_UNSUPPORTED_OPTIONS = {
    "structural_tag": "structural tags are not supported by this server",
    "whitespace_pattern": "a whitespace pattern is not supported; use disable_any_whitespace",
    "disable_additional_properties": 'not supported; set "additionalProperties": false in the schema',
}


def parse_structured_outputs(body: dict) -> StructuredOutputs | None:
    """The one constraint a request body asks for (None: none); InvalidRequest naming the field."""
    asked = [name for name in STRUCTURED_FIELDS if _asks(name, body.get(name))]
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequest(
            f"structured outputs are asked for by {', '.join(repr(n) for n in asked)}; send one of them"
        )
    name = asked[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_object(value)
    kind = name.removeprefix("guided_")
    return _constraint(kind, value, name)


def _asks(name: str, value: Any) -> bool:
    if value is None:
        return False
    return not (name == "response_format" and isinstance(value, dict) and value.get("type") == "text")


def _response_format(value: Any) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise InvalidRequest(
            '\'response_format\' must be an object: {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
        )
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidRequest(
                "response_format.json_schema must be an object with the schema in 'schema': "
                '{"name": "answer", "schema": {"type": "object", ...}}'
            )
        return StructuredOutputs(
            json_schema=_schema_text(spec["schema"], "response_format.json_schema.schema")
        )
    raise InvalidRequest(
        f'response_format.type must be "text", "json_object" or "json_schema", got {shown_value(kind)}'
    )


def _structured_object(value: Any) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise InvalidRequest(
            '\'structured_outputs\' must be an object such as {"json": {...}}, {"regex": "..."}, '
            '{"choice": [...]} or {"grammar": "..."}'
        )
    for key in value:
        if key in _UNSUPPORTED_OPTIONS and _sent(key, value[key]):
            raise InvalidRequest(f"structured_outputs.{key}: {_UNSUPPORTED_OPTIONS[key]}")
        if key not in (*_CONSTRAINTS, *_OPTIONS, *_UNSUPPORTED_OPTIONS):
            raise InvalidRequest(
                f"structured_outputs has an unknown field {shown_value(str(key))}; it takes one of "
                f"{', '.join(_CONSTRAINTS)} and disable_any_whitespace"
            )
    # vLLM counts a constraint by `is not None` (`StructuredOutputsParams.__post_init__`), so
    # json_object false is one too: beside another, vLLM's 400 for two
    given = [key for key in _CONSTRAINTS if value.get(key) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            f"structured_outputs takes exactly one of {', '.join(_CONSTRAINTS)}; got "
            f"{', '.join(given) if given else 'none'}"
        )
    disable_whitespace = boolean_field(
        value, "disable_any_whitespace", False, "structured_outputs.disable_any_whitespace"
    )
    boolean_field(value, "disable_fallback", False, "structured_outputs.disable_fallback")  # no fallback here
    constraint = _constraint(given[0], value[given[0]], f"structured_outputs.{given[0]}")
    return StructuredOutputs(
        json_schema=constraint.json_schema,
        json_object=constraint.json_object,
        regex=constraint.regex,
        choice=constraint.choice,
        grammar=constraint.grammar,
        disable_any_whitespace=disable_whitespace,
    )


def _sent(key: str, value: Any) -> bool:
    """structured_outputs[key], an option this server lacks, asks for something: not null, false
    nor ""; vLLM's bool option (disable_additional_properties) not false as vLLM reads a bool
    ("false", 0 too: `lax_value`)."""
    if key in _BOOL_OPTIONS:
        return value is not None and lax_value(value, bool) is not False
    return value not in (None, False, "")


def _constraint(kind: str, value: Any, label: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs(json_schema=_schema_text(value, label))
    if kind == "json_object":
        flag = lax_value(value, bool)
        if flag is False:
            # vLLM takes it as the request's one constraint, then finds none to compile
            # (`get_structured_output_key`: "No valid structured output parameter found"): an
            # error from its engine, not an answer
            raise InvalidRequest(
                f"'{label}' is false, which asks for no constraint; send true for any JSON object, "
                "or leave structured_outputs out for none"
            )
        if flag is not True:
            raise InvalidRequest(f"'{label}' must be true, got {shown_value(value)}")
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"'{label}' must be a non-empty list of strings")
        if len(value) > MAX_CHOICE_STRINGS:
            raise InvalidRequest(
                f"'{label}' has {len(value)} strings; at most {MAX_CHOICE_STRINGS} are accepted"
            )
        return StructuredOutputs(choice=tuple(checked_text(c, label) for c in value))
    text = checked_text(value, label)
    if not text:
        raise InvalidRequest(f"'{label}' must be a non-empty string")
    return StructuredOutputs(regex=text) if kind == "regex" else StructuredOutputs(grammar=text)


def _schema_text(schema: Any, label: str) -> str:
    """A JSON Schema given as an object or as JSON text -> compact JSON text (its keys' order kept:
    properties are generated in the order the schema lists them)."""
    if isinstance(schema, str):
        if len(schema) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise InvalidRequest(
                f"'{label}' has {len(schema)} characters; at most {MAX_STRUCTURED_OUTPUT_CHARS} are accepted"
            )
        try:
            schema = json.loads(checked_text(schema, label))
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"'{label}' is not JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"'{label}' must be a JSON Schema object, got {shown_value(schema)}")
    return checked_text(json.dumps(schema, ensure_ascii=False, separators=(",", ":")), label)
