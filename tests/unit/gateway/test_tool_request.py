"""A chat request's `tools`, `tool_choice` and tool history (`epd.gateway.tool_request`,
`epd.gateway.chat_messages.parse_messages`, `epd.stages.tools`): what each choice asks of the
answer (a forced choice as a structured output of vLLM's schema), the conversation's tool calls and
results as the chat template gets them and as the wire carries them, and a clear 400 for each
malformed shape."""

from __future__ import annotations

import json

import pytest

from epd.gateway.chat_request import parse_chat_request
from epd.gateway.tokenize_api import parse_tokenize_request
from epd.gateway.tool_request import ToolChoice, check_auto_tool_choice
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, Message, ToolCall, check_messages, text, to_chat_template
from epd.transport.message_convert import (
    messages_from_proto,
    messages_to_proto,
    template_from_proto,
    template_to_proto,
)
from epd.video.types import SamplingOptions
from tests.tool_data import HISTORY, WEATHER

TIME = {"type": "function", "function": {"name": "get_time"}}
"""A function without parameters (the shared `TIME` has an empty object): forced to any object."""


def parse(**fields):
    body = {"model": "epd", "messages": HISTORY, "tools": [WEATHER, TIME], **fields}
    return parse_chat_request(body, "epd", SamplingOptions(), GenerationConfig(max_new_tokens=32))


def test_tool_history_is_parsed_and_rendered_as_transformers_takes_it():
    request = parse()
    assert request.messages == [
        Message.user("weather in Paris?"),
        Message("assistant", (text(""),), (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", (text("sunny"),), tool_call_id="call_1"),
    ]
    assert request.template.tools == (WEATHER, TIME)
    assert request.template.render_options(None).variables == {"tools": [WEATHER, TIME]}
    conversation = to_chat_template(request.messages, "")
    assert conversation[1]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]  # the arguments parsed into the object, as vLLM renders them
    assert conversation[2] == {
        "role": "tool",
        "content": [{"type": "text", "text": "sunny"}],
        "tool_call_id": "call_1",
    }


def test_tools_and_tool_history_survive_the_wire():
    request = parse(chat_template_kwargs={"enable_thinking": False})
    assert messages_from_proto(messages_to_proto(request.messages)) == request.messages
    back = template_from_proto(template_to_proto(request.template))
    assert (back.tools, back.chat_template_kwargs) == ((WEATHER, TIME), {"enable_thinking": False})
    assert template_to_proto(ChatTemplateOptions()) is None


def test_the_sdk_refuses_tools_that_are_not_a_list_even_when_falsy():
    """`tools=False` (or `{}`, `0`) was dropped silently: the answer came without the tools."""
    from epd.client import build_header

    messages = [Message.user("q")]
    for value in (False, {}, 0, "get_weather", {"type": "function"}):
        with pytest.raises(TypeError, match="tools must be a list of function tools"):
            build_header(None, 0, "", {"tools": value}, messages)
    with pytest.raises(TypeError, match="tools must hold JSON values"):
        build_header(None, 0, "", {"tools": [{"type": "function", "x": {1}}]}, messages)
    assert not build_header(None, 0, "", {"tools": []}, messages).HasField("template")
    assert build_header(None, 0, "", {"tools": [WEATHER]}, messages).template.tools_json


def test_tool_choice_defaults_and_modes():
    assert parse().tool_choice == ToolChoice("auto")  # with tools: auto, as OpenAI's and vLLM's
    assert parse(tools=None).tool_choice == ToolChoice("none")
    assert parse(tools=[], tool_choice="auto").tool_choice == ToolChoice("none")  # asks for nothing
    none = parse(tool_choice="none")
    assert (none.tool_choice, none.template.tools) == (ToolChoice("none"), (WEATHER, TIME))  # still rendered
    assert none.generation.structured_outputs is None
    assert parse(parallel_tool_calls=False).tool_choice == ToolChoice("auto", parallel=False)
    assert parse(parallel_tool_calls="no").tool_choice == ToolChoice("auto", parallel=False)  # vLLM's bool
    with pytest.raises(InvalidRequest, match="'parallel_tool_calls' must be true or false"):
        parse(parallel_tool_calls="one at a time")


def test_a_named_function_is_forced_to_its_parameters_schema():
    request = parse(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert request.tool_choice == ToolChoice("named", "get_weather")
    schema = json.loads(request.generation.structured_outputs.json_schema)
    assert schema == WEATHER["function"]["parameters"]
    request = parse(tool_choice={"type": "function", "function": {"name": "get_time"}})  # no parameters
    assert json.loads(request.generation.structured_outputs.json_schema) == {
        "type": "object",
        "properties": {},
    }


def test_required_is_forced_to_vllms_array_of_calls():
    defs = {"Unit": {"enum": ["C", "F"]}}
    with_defs = {
        "type": "function",
        "function": {
            "name": "get_temp",
            "parameters": {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": defs},
        },
    }
    request = parse(tools=[WEATHER, with_defs], tool_choice="required")
    schema = json.loads(request.generation.structured_outputs.json_schema)
    assert (schema["type"], schema["minItems"], schema["$defs"]) == ("array", 1, defs)
    alternatives = schema["items"]["anyOf"]
    assert [a["properties"]["name"] for a in alternatives] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_temp"]},
    ]
    assert alternatives[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert "$defs" not in alternatives[1]["properties"]["parameters"]  # gathered at the top
    assert all(a["required"] == ["name", "parameters"] for a in alternatives)
    assert with_defs["function"]["parameters"]["$defs"] == defs  # the request's own schema untouched


def test_auto_needs_the_servers_flag():
    check_auto_tool_choice(ToolChoice("auto"), enabled=True)
    for choice in (ToolChoice("none"), ToolChoice("required"), ToolChoice("named", "f")):
        check_auto_tool_choice(choice, enabled=False)  # no flag needed, as vLLM's
    with pytest.raises(
        InvalidRequest, match="needs the server started with --enable-auto-tool-choice and --tool-call-parser"
    ):
        check_auto_tool_choice(ToolChoice("auto"), enabled=False)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
         r"tool_choice names the function \"get_wether\", which is not in 'tools' \(its functions: 'get_weather', 'get_time'\)"),
        ({"tool_choice": "sometimes"}, "'tool_choice' must be \"none\", \"auto\", \"required\" or"),
        ({"tool_choice": {"function": {"name": "get_weather"}}}, "'tool_choice' must be"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice \"required\" needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice \"required\" forces the answer with a structured output of its own; leave response_format"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "guided_regex": "a+"},
         "forces the answer with a structured output of its own"),
        ({"tools": {"type": "function"}}, "'tools' must be a list of function tools"),
        ({"tools": [{"type": "retrieval"}]}, r"tools\[0\] must be a function tool"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
         r"tools\[0\].function.name must be a function's name of 1 to 64 letters, digits"),
        ({"tools": [{"type": "function", "function": {}}]}, r"tools\[0\].function.name must be"),
        ({"tools": [WEATHER, WEATHER]}, "two functions named 'get_weather'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
         r"tools\[0\].function.parameters must be a JSON Schema object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]},
         r"tools\[0\].function has unknown fields \['params'\]"),
        ({"tools": [TIME] * 129}, "'tools' has 129 tools; at most 128"),
        ({"functions": [WEATHER["function"]]}, "'functions' is not supported by this server; leave it unset.*send them as 'tools'"),
        ({"function_call": {"name": "get_weather"}}, "'function_call' is not supported.*send it as 'tool_choice'"),
    ],
)  # fmt: skip
def test_malformed_tools_and_choices_are_refused_naming_what_to_change(fields, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(**fields)


def _history(**call_changes) -> list[dict]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    call.update(call_changes)
    return [HISTORY[0], {**HISTORY[1], "tool_calls": [call]}, HISTORY[2]]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        (_history(function={"name": "get_weather", "arguments": "{city: Paris}"}),
         r"messages\[1\].tool_calls\[0\].function.arguments is not JSON text; send the call's arguments as a JSON object's text"),
        (_history(function={"name": "get_weather", "arguments": "[1]"}),
         r"messages\[1\].tool_calls\[0\].function.arguments must be a JSON object's text"),
        (_history(function={"name": "get_weather"}), r"messages\[1\].tool_calls\[0\] needs a string id, function.name"),
        (_history(function={"name": "", "arguments": "{}"}), r"messages\[1\].tool_calls\[0\].function.name must be"),
        (_history(type="code"), r"messages\[1\].tool_calls\[0\] must be"),
        ([{**HISTORY[0], "tool_calls": _history()[1]["tool_calls"]}], "messages\\[0\\] is a user message with tool calls"),
        ([HISTORY[0], {**HISTORY[2], "tool_call_id": 7}], r"messages\[1\].tool_call_id must be a string"),
        ([HISTORY[0], {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}],
         r"messages\[1\] is a tool message; put the image_url part in a user message"),
    ],
)  # fmt: skip
def test_malformed_tool_history_is_refused_naming_what_to_change(messages, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(messages=messages)


def test_every_door_checks_the_tool_history_the_message_model_holds():
    """gRPC's and the SDK's messages are checked by `check_messages`, not by the HTTP parser."""
    bad = [Message.user("hi"), Message("assistant", (text(""),), (ToolCall("c", "f", "{oops"),))]
    with pytest.raises(InvalidRequest, match=r"messages\[1\].tool_calls\[0\].function.arguments is not JSON"):
        check_messages(bad)
    with pytest.raises(InvalidRequest, match=r"messages\[0\] is a user message with a tool_call_id"):
        check_messages([Message("user", (text("hi"),), tool_call_id="c")])
    check_messages(
        [*bad[:1], Message("tool", (text("42"),), tool_call_id="c")]
    )  # a tool's result last: answered
    with pytest.raises(
        InvalidRequest, match="cannot set 'tools': send them in the request's own 'tools' field"
    ):
        check_messages([Message.user("hi")], template=ChatTemplateOptions(chat_template_kwargs={"tools": []}))
    with pytest.raises(InvalidRequest, match=r"tools\[0\] must be a function tool"):
        check_messages([Message.user("hi")], template=ChatTemplateOptions(tools=({"type": "x"},)))


def test_tokenize_renders_the_tools_as_a_chat_request():
    request = parse_tokenize_request({"model": "epd", "messages": HISTORY, "tools": [WEATHER]}, "epd")
    assert request.template.tools == (WEATHER,)
    assert request.messages == parse().messages


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required"},  # no tools: a chat request's 400
        {"tool_choice": {"type": "function", "function": {"name": "not_a_tool"}}},
        {"tool_choice": "sometimes", "parallel_tool_calls": "yes"},
    ],
)
def test_tokenize_ignores_tool_choice_as_vllms_does(fields):
    """/tokenize renders the tools; what shapes an answer alone (tool_choice, parallel_tool_calls)
    it ignores, as vLLM's TokenizeChatRequest, which has neither, does."""
    request = parse_tokenize_request({"model": "epd", "messages": HISTORY, **fields}, "epd")
    assert request.template.tools == ()
    request = parse_tokenize_request(
        {"model": "epd", "messages": HISTORY, "tools": [WEATHER], **fields}, "epd"
    )
    assert request.template.tools == (WEATHER,)
