"""Structured outputs as a client asks for them over HTTP (no HTTP in here): OpenAI's
`response_format`, vLLM's `structured_outputs` object and its older `guided_*` fields, read into
one `StructuredOutputs` (a JSON body, chat completions' and legacy completions' alike).

    response_format  {"type": "text"} (nothing), {"type": "json_object"} (any JSON object),
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}
    structured_outputs  {"json": schema, "json_object": true, "regex": "...", "choice": [...],
                     "grammar": "EBNF"} (one of them) and "disable_any_whitespace"
    guided_json / guided_regex / guided_choice / guided_grammar  vLLM's older names of the same

A request asks in one of these ways, or with `response_format` beside `structured_outputs` (or a
`guided_*` field), which vLLM merges (`structured_outputs_from_response_format`,
`vllm/entrypoints/generate/base/protocol.py`): response_format's constraint replaces the same one
of structured_outputs' (json_schema its `json`, json_object its `json_object`), keeping its
options; a different one is two constraints, vLLM's 400; so is structured_outputs beside a
`guided_*` field (400 naming the fields it sent). What this server does
not implement (vLLM's `structural_tag`, `whitespace_pattern`, ...) is refused here, by name; the
sizes by the pipeline's check before any media is encoded (`StructuredOutputs.validate`); what
xgrammar cannot compile by prefill, with the compiler's reason (the gateway needs no xgrammar).
"""

from __future__ import annotations

import json
from dataclasses import replace
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
    base = [name for name in asked if name != "response_format"]
    if len(base) > 1:
        raise InvalidRequest(
            f"structured outputs are asked for by {', '.join(repr(n) for n in base)}; send one of them"
        )
    override = _response_format(body["response_format"]) if "response_format" in asked else None
    if not base:
        return override
    name = base[0]
    if name == "structured_outputs":
        return _structured_object(body[name], override)
    kind = name.removeprefix("guided_")
    if override is not None:
        # vLLM before v0.12 read them so too: response_format's schema replaced guided_json, and
        # anything else beside it was two constraints
        _check_merge(override, kind, name)
        return override
    return _constraint(kind, body[name], name)


_REPLACES = {"json_schema": "json", "json_object": "json_object"}
"""response_format's constraint (`StructuredOutputs.kind`) -> the field of structured_outputs it
replaces when both are sent (vLLM's `structured_outputs_from_response_format`)."""


def _check_merge(override: StructuredOutputs, kind: str, label: str) -> None:
    """InvalidRequest unless response_format's constraint (`override`) replaces the request's other
    one, `kind` (sent as `label`): two different constraints are vLLM's 400 too
    (`StructuredOutputsParams.__post_init__`, "only use one kind")."""
    replaced = _REPLACES[override.kind]
    if kind != replaced:
        raise InvalidRequest(
            f"response_format asks for {override.kind} and '{label}' for {kind}: two constraints; send "
            f"one of them (response_format replaces only the same constraint: json_schema replaces "
            f"structured_outputs.json, json_object replaces structured_outputs.json_object)"
        )


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


def _structured_object(value: Any, override: StructuredOutputs | None = None) -> StructuredOutputs:
    """structured_outputs' one constraint and its options; with `override` (response_format's
    constraint, sent beside it) that constraint in place of its own (`_check_merge`)."""
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
    if override is not None:
        # vLLM's `replace(structured_outputs, **overrides)`: the value replaced is not read
        _check_merge(override, given[0], f"structured_outputs.{given[0]}")
        return replace(override, disable_any_whitespace=disable_whitespace)
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
