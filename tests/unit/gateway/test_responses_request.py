"""The Responses API body (`POST /v1/responses`) -> the chat request the handler runs: input items,
instructions, tools, text.format, and what is refused with a 400 that says what to send (any body:
a request or a 400). Its answer is test_responses_answer.py, its logprobs test_responses_logprobs.py,
its failures test_responses_failures.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd.gateway.responses_protocol import parse_responses_request
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.errors import InvalidRequest, NotFound
from epd.video.types import SamplingOptions
from tests.unit.gateway.responses_bodies import TOOL, VIDEO, parse, summary, whole


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    request = parse(input="hi", instructions="be brief", max_output_tokens=5, temperature=0.5, top_k=3)
    assert [(m.role, m.parts[0].text) for m in request.messages] == [("system", "be brief"), ("user", "hi")]
    assert request.generation.max_new_tokens == 5 and not request.generation.fit_max_new_tokens
    assert (request.generation.temperature, request.generation.top_k) == (0.5, 3)
    assert request.responses is not None and request.responses["instructions"] == "be brief"
    assert request.media_url == "" and not request.stream


def test_items_parts_video_and_tool_history():
    request = parse(
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what?"},
                    {"type": "video_url", "video_url": {"url": VIDEO}},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            {"type": "reasoning", "summary": []},
        ],
        tools=[TOOL],
        tool_choice="none",
        media={"num_frames": 4},
    )
    roles = [m.role for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assert [p.type for p in request.messages[1].parts] == ["text", "video"]
    assert (request.media_url, request.modality, request.sampling.num_frames) == (VIDEO, "video", 4)
    assert [c.id for c in request.messages[2].tool_calls] == ["c1", "c2"]  # one turn's calls
    assert request.messages[3].tool_call_id == "c1"
    assert request.template.tools[0] == {
        "type": "function",
        "function": {k: v for k, v in TOOL.items() if k != "type"},
    }


def test_an_input_image_is_chats_image_part():
    request = parse(
        input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
        ]
    )
    assert (request.media_url, request.modality) == ("data:image/png;base64,AA", "image")


def test_a_named_function_and_text_format_are_chats():
    named = parse(input="hi", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert (named.tool_choice.mode, named.tool_choice.function) == ("named", "get_weather")
    assert named.generation.structured_outputs is not None  # the function's parameters' grammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    structured = parse(input="hi", text=fmt).generation.structured_outputs
    assert structured is not None and json.loads(structured.json_schema) == schema
    assert parse(
        input="hi", text={"format": {"type": "json_object"}}
    ).generation.structured_outputs == StructuredOutputs(json_object=True)
    assert parse(input="hi", text={"format": {"type": "text"}}).generation.structured_outputs is None


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            {"input": "hi", "store": True},
            "'store': true is not supported.*epd keeps no responses.*VLLM_ENABLE",
        ),
        (
            {"input": "hi", "previous_response_id": "resp_1"},
            "'previous_response_id' is not supported: epd keeps no",
        ),
        ({"input": "hi", "conversation": "c"}, "'conversation' is not supported"),
        ({"input": "hi", "background": True}, "'background' is not supported"),
        # vLLM's bools, read as its pydantic reads them
        ({"input": "hi", "store": "yes"}, "'store': true is not supported"),
        ({"input": "hi", "store": "sometimes"}, "'store' must be true or false, got 'sometimes'"),
        ({"input": "hi", "background": "on"}, "'background' is not supported"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "'messages' is chat completions' field.*'input'"),
        ({"input": "hi", "max_tokens": 4}, "takes 'max_output_tokens'"),
        ({"input": "hi", "response_format": {"type": "json_object"}}, "takes 'text'"),
        ({}, "'input' must be a string or a non-empty list"),
        ({"input": []}, "'input' must be a string or a non-empty list"),
        ({"input": [{"type": "web_search_call"}]}, "input\\[0\\] has type 'web_search_call'"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "needs 'output'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "unsupported content part 'input_file'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "needs 'image_url'.*no files API",
        ),
        (
            {"input": "hi", "tools": [{"type": "web_search"}]},
            "tools\\[0\\] has type 'web_search'.*hosted tools",
        ),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "'tool_choice' must be"),
        (
            {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "not in 'tools'",
        ),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format has type 'xml'"),
        ({"input": "hi", "text": "json"}, "'text' must be an object"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a"}}},
            "needs the schema in 'schema'",
        ),
        ({"input": "hi", "instructions": 3}, "'instructions' must be a string"),
        ({"input": "hi", "metadata": "x"}, "'metadata' must be an object"),
        ({"input": "hi", "reasoning": "high"}, "'reasoning' must be an object"),
        ({"input": "hi", "max_output_tokens": 0}, "'max_output_tokens' must be an integer from 1"),
        (
            {"input": "hi", "include": ["reasoning.encrypted_content", "web_search_call.results"]},
            "'include' value 'web_search_call.results' is not one this server takes; it takes "
            '"code_interpreter_call.outputs", .*"reasoning.encrypted_content"',
        ),
        ({"input": "hi", "include": "message.output_text.logprobs"}, "'include' must be a list of strings"),
        ({"input": "hi", "top_logprobs": "2.5"}, "'top_logprobs' must be an integer"),
        ({"input": [{"role": "robot", "content": "x"}]}, "message roles must be"),
        ({"input": "hi", "best_of": 2}, "'best_of' is not supported"),
        ({"input": "hi", "mm_processor_kwargs": {"fps": 1}}, 'frame sampling goes in "media"'),
    ],
)
def test_refusals_say_what_to_send(body, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(**body)


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ({"instructions": "be \ud800", "input": "hi"}, "instructions"),
        ({"input": "hi \ud800"}, "input"),
        ({"instructions": "x", "input": [{"role": "user", "content": "\ud800"}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "\ud800"}]}]},
            "input[0].content[1].text",
        ),
    ],
)  # fmt: skip
def test_a_text_chat_refuses_is_named_as_the_body_wrote_it(body, name):
    """Chat's refusal of a text (a lone surrogate no UTF-8 encoder takes) names the field the
    Responses body sent it in: 'instructions', not "'instructions text'"."""
    with pytest.raises(InvalidRequest) as refused:
        parse(**body)
    assert str(refused.value) == f"'{name}' is not valid Unicode text (it holds a lone surrogate escape)"


def _call(call_id: str, arguments: str = "{}", name: str = "get_weather") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        # The instructions are message 0, one turn's calls one message: chat's messages[2].tool_calls[1].
        (
            [{"role": "user", "content": "hi"}, _call("c1"), _call("c2", "[1]")],
            "input[2].arguments must be a JSON object's text",
        ),
        ([{"role": "user", "content": "hi"}, _call("c1"), _call("c2", name="a b")], "input[2].name must be"),
        ([{"role": "user", "content": 3}], "input[0].content must be a string or a non-empty list"),
        # A reasoning item is no message: chat's messages[3] is input[4].
        (
            [
                {"type": "reasoning", "summary": []},
                {"role": "user", "content": "hi"},
                _call("c1"),
                _call("c2"),
                {"type": "function_call_output", "call_id": 3, "output": "x"},
            ],
            "input[4].call_id must be a string",
        ),
    ],
)
def test_chats_refusals_of_a_message_name_its_input_item(items, message):
    """Chat's checks name `messages[i]`; a Responses body has no messages, and its `input` index
    differs after `instructions` or merged function_call items: the 400 names the item."""
    with pytest.raises(InvalidRequest) as refused:
        parse(instructions="Be brief.", input=items)
    assert str(refused.value).startswith(message) and "messages[" not in str(refused.value)


@pytest.mark.parametrize(
    "body, match",
    [
        (  # after instructions (messages[1] in chat's request) and with input_text (chat's "text")
            {"instructions": "be brief", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "a text part of input\\[0\\] needs its text",
        ),
        (  # the second of a turn's calls (chat's messages[1].tool_calls[1].function.arguments)
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{bad"},
                ],
                "tools": [TOOL],
            },
            "^input\\[2\\].arguments is not JSON text",
        ),
        (  # chat's messages[2].tool_call_id
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": 7, "output": "sunny"},
                ],
                "tools": [TOOL],
            },
            "^input\\[2\\].call_id must be a string",
        ),
        (  # chat's messages[1].tool_calls[0] without function.name
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "arguments": "{}"},
                ],
                "tools": [TOOL],
            },
            "^input\\[1\\] needs a string call_id, name and arguments",
        ),
    ],
)
def test_chats_refusals_name_the_input_item(body, match):
    """Chat's parser refuses the converted request: its message names the Responses body's item
    (input[k], its call_id and arguments), not the chat messages the body never had."""
    with pytest.raises(InvalidRequest, match=match):
        parse(**body)


def test_another_model_is_a_404_and_unknown_fields_are_logged(caplog):
    with pytest.raises(NotFound):
        parse_responses_request({"model": "x", "input": "hi"}, "m", SamplingOptions(), GenerationConfig())
    with caplog.at_level("WARNING"):
        parse(input="hi", store=False, prompt_cache_key="k", reasoning={"effort": "low"}, user="u")
    assert "ignored request fields ['prompt_cache_key']" in caplog.text
    parse(input="hi", store="no", background=0)  # vLLM's bools: "no" and 0 are false


LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=12))
ANY = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "video_url", "input_file", "x"])},
    optional={"text": ANY, "image_url": ANY, "video_url": ANY},
)
ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "x"]),
        "content": st.one_of(st.text(max_size=8), st.lists(PART, max_size=2), ANY),
        "call_id": ANY,
        "name": ANY,
        "arguments": ANY,
        "output": ANY,
    },
)
BODY = st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=8), st.lists(ITEM, max_size=3), ANY)},
    optional={
        name: ANY
        for name in (
            "instructions",
            "tools",
            "tool_choice",
            "text",
            "reasoning",
            "metadata",
            "store",
            "max_output_tokens",
            "temperature",
            "stream",
            "parallel_tool_calls",
            "user",
            "include",
            "top_logprobs",
        )
    },  # fmt: skip
)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(body=BODY)
def test_any_body_parses_or_is_a_400_and_its_answer_shapes(body):
    """Whatever the JSON, a request or a clear 400: never another exception (a 500)."""
    try:
        request = parse(**body)
    except InvalidRequest as exc:
        assert str(exc)
        return
    json.dumps(whole(summary("x</think>y"), request, thinking=True))
