"""Structured outputs as the HTTP API reads them: OpenAI's response_format, vLLM's
structured_outputs and its guided_* fields -> one `StructuredOutputs`, and the 400s for what is
malformed, unsupported or asked for twice."""

from __future__ import annotations

import json

import pytest

from epd.gateway.chat_request import parse_chat_request
from epd.gateway.completions_protocol import parse_completion_request
from epd.model_runtime.sampling import MAX_STRUCTURED_OUTPUT_CHARS, GenerationConfig, StructuredOutputs
from epd.stages.errors import InvalidRequest
from epd.video.types import SamplingOptions

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


def structured(**fields):
    body = {"model": "epd", "messages": [{"role": "user", "content": "which colour?"}], **fields}
    return parse_chat_request(
        body, "epd", SamplingOptions(), GenerationConfig()
    ).generation.structured_outputs


@pytest.mark.parametrize(("fields", "want"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json_schema=SCHEMA_TEXT)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json_schema=SCHEMA_TEXT)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, StructuredOutputs(json_schema=SCHEMA_TEXT)),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     StructuredOutputs(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_fallback": True}}, StructuredOutputs(regex="[0-9]+")),
    # vLLM's bools, read as its pydantic reads them: "yes" and 1 are true, "no" and 0 false
    ({"structured_outputs": {"json_object": "yes", "disable_any_whitespace": 1}},
     StructuredOutputs(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"regex": "a", "json_object": None, "disable_additional_properties": "false"}},
     StructuredOutputs(regex="a")),
    ({"structured_outputs": {"choice": ["red", "blue"]}}, StructuredOutputs(choice=("red", "blue"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputs(grammar='root ::= "a"')),
    ({"guided_json": SCHEMA}, StructuredOutputs(json_schema=SCHEMA_TEXT)),
    ({"guided_regex": "a|b"}, StructuredOutputs(regex="a|b")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputs(choice=("yes", "no"))),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputs(grammar='root ::= "x"')),
])  # fmt: skip
def test_each_way_of_asking_reads_as_one_constraint(fields, want):
    assert structured(**fields) == want


OTHER_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


@pytest.mark.parametrize(("fields", "want"), [
    # response_format's constraint replaces the same one of structured_outputs', whose options
    # stay (vLLM's `structured_outputs_from_response_format`: `replace(structured_outputs, ...)`)
    ({"structured_outputs": {"json": OTHER_SCHEMA, "disable_any_whitespace": True},
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     StructuredOutputs(json_schema=SCHEMA_TEXT, disable_any_whitespace=True)),
    ({"structured_outputs": {"json_object": False}, "response_format": {"type": "json_object"}},
     StructuredOutputs(json_object=True)),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"},
      "response_format": {"type": "json_object"}},
     StructuredOutputs(json_object=True, disable_any_whitespace=True)),
    # "text" asks for nothing: structured_outputs alone
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "text"}}, StructuredOutputs(regex="a")),
    # vLLM before v0.12: response_format's schema replaced guided_json
    ({"guided_json": OTHER_SCHEMA, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     StructuredOutputs(json_schema=SCHEMA_TEXT)),
])  # fmt: skip
def test_response_format_beside_structured_outputs_is_merged_as_vllm_merges_them(fields, want):
    assert structured(**fields) == want


def test_legacy_completions_read_them_too():
    body = {"model": "epd", "prompt": "Colours:", "guided_choice": ["red", "blue"]}
    request = parse_completion_request(body, "epd", SamplingOptions(), GenerationConfig())
    assert request.generation.structured_outputs == StructuredOutputs(choice=("red", "blue"))


@pytest.mark.parametrize(("fields", "message"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "response_format asks for json_object and 'guided_regex' for regex: two constraints; send one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}},
     "response_format asks for json_object and 'structured_outputs.json' for json: two constraints"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
      "structured_outputs": {"regex": "a"}}, "'structured_outputs.regex' for regex: two constraints"),
    # structured_outputs must hold its own one constraint (vLLM's pydantic model refuses none)
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     "got none"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"},
     "asked for by 'structured_outputs', 'guided_regex'; send one of them"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of json, json_object, regex"),
    ({"structured_outputs": {}}, "got none"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag: structural tags"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"structured_outputs": {"regx": "a"}}, "unknown field 'regx'"),
    ({"structured_outputs": {"json_object": "maybe"}}, "'structured_outputs.json_object' must be true, got 'maybe'"),
    # vLLM counts a constraint by `is not None`: json_object false is one (two with a regex: its
    # 400), alone one that asks for nothing, which vLLM's engine then fails on
    ({"structured_outputs": {"regex": "a", "json_object": "no"}}, "exactly one of json, json_object, regex.*; got json_object, regex"),
    ({"structured_outputs": {"json_object": False}}, "is false, which asks for no constraint; send true"),
    ({"structured_outputs": {"json_object": 0, "disable_any_whitespace": True}}, "or leave structured_outputs out"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": "on"}}, "disable_additional_properties"),
    ({"structured_outputs": "json"}, "'structured_outputs' must be an object"),
    ({"response_format": {"type": "xml"}}, 'response_format.type must be "text", "json_object" or "json_schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "the schema in 'schema'"),
    ({"guided_json": "{not json"}, "'guided_json' is not JSON"),
    ({"guided_json": [1]}, "'guided_json' must be a JSON Schema object"),
    ({"guided_choice": []}, "'guided_choice' must be a non-empty list of strings"),
    ({"guided_choice": ["a", 1]}, "'guided_choice' must be a non-empty list of strings"),
    ({"guided_regex": ""}, "'guided_regex' must be a non-empty string"),
    ({"guided_json": "x" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)}, "at most 65536 are accepted"),
    ({"guided_whitespace_pattern": "\\s*"}, "'guided_whitespace_pattern' is not supported"),
])  # fmt: skip
def test_malformed_or_unsupported_asks_are_400s_naming_the_field(fields, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        structured(**fields)


def test_sizes_are_bounded_in_the_config_where_every_door_checks_them():
    with pytest.raises(ValueError, match="at most 65536 are accepted"):
        GenerationConfig(structured_outputs=StructuredOutputs(grammar="x" * 65537)).validate(32)
    with pytest.raises(ValueError, match="choice cannot contain an empty string"):
        GenerationConfig(structured_outputs=StructuredOutputs(choice=("a", ""))).validate(32)
    with pytest.raises(ValueError, match="got regex, grammar"):
        GenerationConfig(structured_outputs=StructuredOutputs(regex="a", grammar="b")).validate(32)
