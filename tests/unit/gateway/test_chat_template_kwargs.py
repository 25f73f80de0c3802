"""vLLM's `chat_template_kwargs` on a chat or /tokenize request: read by the HTTP door, carried by
the SDK's AskHeader and the wire as JSON text (an integer stays an integer), checked by
`epd.stages.template_kwargs` (names the server sets itself, values that are not JSON's, nesting and
size past the bounds: a 400 / INVALID_ARGUMENT saying what to change)."""

from __future__ import annotations

import grpc
import pytest

from epd.client import build_header
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.completions_protocol import parse_completion_request
from epd.gateway.tokenize_api import parse_tokenize_request
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, Message, check_messages
from epd.stages.template_kwargs import MAX_DEPTH, MAX_JSON_CHARS, check_chat_template_kwargs
from epd.transport import convert
from epd.transport.errors import status_of
from epd.video.types import SamplingOptions

MODEL = "epd"
USER = [{"role": "user", "content": "name a colour"}]


def parse(body):
    return parse_chat_request(
        {"model": MODEL, "messages": USER, **body},
        MODEL,
        SamplingOptions(),
        GenerationConfig(max_new_tokens=8),
    )


def test_the_http_doors_read_them():
    kwargs = {"enable_thinking": False, "n": 3, "style": {"tone": ["brief"]}, "none": None}
    assert parse({"chat_template_kwargs": kwargs}).template == ChatTemplateOptions(
        chat_template_kwargs=kwargs
    )
    assert parse({"chat_template_kwargs": None}).template == ChatTemplateOptions()
    assert parse({}).template == ChatTemplateOptions()
    tokenize = parse_tokenize_request({"messages": USER, "chat_template_kwargs": kwargs}, MODEL)
    assert tokenize.template.chat_template_kwargs == kwargs
    # Not a field of vLLM's completions (a raw prompt has no template): logged, as vLLM ignores it.
    completion = parse_completion_request(
        {"model": MODEL, "prompt": "hi", "chat_template_kwargs": kwargs},
        MODEL,
        SamplingOptions(),
        GenerationConfig(max_new_tokens=8),
    )
    assert completion.template == ChatTemplateOptions()


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ("enable_thinking", "'chat_template_kwargs' must be an object of the chat template's variables"),
        ([["enable_thinking", False]], "'chat_template_kwargs' must be an object"),
        ({"add_generation_prompt": False}, "cannot set 'add_generation_prompt': set the request's own"),
        ({"continue_final_message": True}, "cannot set 'continue_final_message': set the request's own"),
        ({"messages": []}, "cannot set 'messages': send the conversation in 'messages'"),
        (
            {"tools": [{"type": "function"}]},
            "cannot set 'tools': send them in the request's own 'tools' field",
        ),
        ({"chat_template": "{{ x }}"}, "cannot set 'chat_template'"),
        ({"tokenize": True}, "cannot set 'tokenize'"),
        ({"return_dict": True}, "cannot set 'return_dict': the server sets it itself"),
        ({"raise_exception": "x"}, "cannot set 'raise_exception'"),
        ({"bad-name": 1}, "a template variable's name is letters, digits and underscores"),
        ({"1st": 1}, "a template variable's name is letters"),
        ({"x": "y" * MAX_JSON_CHARS}, f"the limit is {MAX_JSON_CHARS}: send fewer or shorter variables"),
    ],
)
def test_what_the_server_does_not_pass_on_is_a_400_saying_what_to_change(kwargs, said):
    with pytest.raises(InvalidRequest, match=said) as refused:
        parse({"chat_template_kwargs": kwargs})
    assert status_of(refused.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidRequest, match=said):
        parse_tokenize_request({"messages": USER, "chat_template_kwargs": kwargs}, MODEL)


def test_values_are_jsons_bounded_in_depth():
    deep: object = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(InvalidRequest, match=f"nested more than {MAX_DEPTH} lists or objects deep"):
        check_chat_template_kwargs({"x": deep})
    for value, said in (
        (float("nan"), "chat_template_kwargs.x is nan; a template variable's number must be finite"),
        ({1: "a"}, "chat_template_kwargs.x has the key 1; an object's keys are strings"),
        ({"a", "b"}, "chat_template_kwargs.x is a set; a template variable is null"),
        (b"bytes", "chat_template_kwargs.x is a bytes"),
    ):
        with pytest.raises(InvalidRequest, match=said):
            check_chat_template_kwargs({"x": value})
    # Every door's message check refuses them too (the SDK's and gRPC's requests, prefill's own).
    with pytest.raises(InvalidRequest, match="cannot set 'messages'"):
        check_messages(
            [Message.user("q")], template=ChatTemplateOptions(chat_template_kwargs={"messages": 1})
        )
    check_chat_template_kwargs({"x": [[[1]]], "y": {"z": 1.5}, "t": "text"})


def test_the_sdk_and_the_wire_carry_them_as_json():
    messages = [Message.user("q")]
    kwargs = {"enable_thinking": False, "n": 3, "ratio": 0.5, "names": ["a", "é"]}
    header = build_header(None, 0, "", {"chat_template_kwargs": kwargs}, messages)
    options = convert.template_from_proto(header.template)
    assert options == ChatTemplateOptions(chat_template_kwargs=kwargs)
    assert type(options.chat_template_kwargs["n"]) is int  # a Struct would have made it 3.0
    assert not build_header(None, 0, "", {"chat_template_kwargs": {}}, messages).HasField("template")
    both = ChatTemplateOptions(False, True, {"enable_thinking": True})
    message = convert.template_to_proto(both)
    assert message is not None and convert.template_from_proto(message) == both
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        build_header(None, 0, "", {"chat_template_kwargs": "enable_thinking"}, messages)
    with pytest.raises(TypeError, match="chat_template_kwargs must hold JSON values"):
        build_header(None, 0, "", {"chat_template_kwargs": {"x": {1, 2}}}, messages)
    # A gRPC caller's text that is not a JSON object: INVALID_ARGUMENT, not INTERNAL.
    for text in ("{", "[1]", "x" * (MAX_JSON_CHARS + 1)):
        header.template.chat_template_kwargs_json = text
        with pytest.raises(InvalidRequest, match="chat_template_kwargs"):
            convert.template_from_proto(header.template)
