"""vLLM's `add_generation_prompt` and `continue_final_message` on a chat request: read by the HTTP
door, carried by the SDK's AskHeader and the wire, checked by the message model as vLLM checks
them (both true is a 400 naming the fields; continuing needs the assistant's message last)."""

from __future__ import annotations

import pytest

from epd.client import build_header
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.http_errors import http_status_of
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, Message, check_messages
from epd.transport import convert
from epd.transport.errors import status_of
from epd.video.types import SamplingOptions

MODEL = "epd"
ANSWERED = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "The colour is"}]
BOTH = "add_generation_prompt and continue_final_message cannot both be true"
NOT_ASSISTANTS = (
    "continue_final_message continues the last message, the assistant's, but the last message is the user's"
)


def parse(body):
    return parse_chat_request(
        {"model": MODEL, **body}, MODEL, SamplingOptions(), GenerationConfig(max_new_tokens=8)
    )


def test_the_http_door_reads_both_fields_and_takes_an_assistant_message_last():
    assert parse({"messages": ANSWERED[:1]}).template == ChatTemplateOptions()
    # The defaults with the assistant's message last: a new answer after it, as vLLM renders it.
    assert parse({"messages": ANSWERED}).template == ChatTemplateOptions()
    continued = parse({"messages": ANSWERED, "add_generation_prompt": False, "continue_final_message": True})
    assert continued.template == ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    assert continued.messages[-1] == Message.assistant("The colour is")
    closed = parse({"messages": ANSWERED[:1], "add_generation_prompt": False})
    assert closed.template.add_generation_prompt is False
    # The answer's role, as vLLM's: the last message's without a generation prompt.
    assert (continued.response_role, closed.response_role, parse({"messages": ANSWERED}).response_role) == (
        "assistant",
        "user",
        "assistant",
    )


@pytest.mark.parametrize(
    "body,match",
    [
        # add_generation_prompt's default is true
        ({"messages": ANSWERED, "continue_final_message": True}, BOTH),
        ({"messages": ANSWERED, "continue_final_message": True, "add_generation_prompt": True}, BOTH),
        (
            {"messages": ANSWERED[:1], "continue_final_message": True, "add_generation_prompt": False},
            NOT_ASSISTANTS,
        ),
        (
            {"messages": ANSWERED, "continue_final_message": "continue"},
            "'continue_final_message' must be true or false",
        ),
        ({"messages": ANSWERED, "add_generation_prompt": 2}, "'add_generation_prompt' must be true or false"),
    ],
)
def test_refusals_are_400s_that_say_what_to_change(body, match):
    with pytest.raises(InvalidRequest, match=match) as info:
        parse(body)
    assert http_status_of(status_of(info.value)[0])[0] == 400


def test_the_message_model_checks_the_options_and_still_refuses_a_system_message_last():
    check_messages([Message.user("q"), Message.assistant("a")])
    check_messages([Message.user("q"), Message.assistant("a")], template=ChatTemplateOptions(False, True))
    with pytest.raises(InvalidRequest, match="last message is the system's; end with the user's message"):
        check_messages([Message.user("q"), Message.system("a")])
    with pytest.raises(InvalidRequest, match=BOTH):
        check_messages([Message.user("q"), Message.assistant("a")], template=ChatTemplateOptions(True, True))
    with pytest.raises(InvalidRequest, match=NOT_ASSISTANTS):
        check_messages([Message.user("q")], template=ChatTemplateOptions(False, True))


def test_the_sdk_sends_them_in_the_ask_header_and_the_wire_keeps_the_default():
    messages = [Message.user("q"), Message.assistant("a")]
    header = build_header(
        None, 0, "", {"add_generation_prompt": False, "continue_final_message": True}, messages
    )
    assert convert.template_from_proto(header.template) == ChatTemplateOptions(False, True)
    # Unset on the wire when not asked: add_generation_prompt's default (true) is kept.
    plain = build_header(None, 0, "", {}, messages)
    assert not plain.HasField("template")
    assert convert.template_from_proto(plain.template) == ChatTemplateOptions()
    only_agp = build_header(None, 0, "", {"add_generation_prompt": False}, messages)
    assert convert.template_from_proto(only_agp.template) == ChatTemplateOptions(add_generation_prompt=False)
    assert convert.template_to_proto(ChatTemplateOptions()) is None  # the defaults leave the field unset
    for options in (ChatTemplateOptions(False, True), ChatTemplateOptions(False, False)):
        message = convert.template_to_proto(options)
        assert message is not None and convert.template_from_proto(message) == options
    with pytest.raises(TypeError, match="continue_final_message must be True or False, got 'yes'"):
        build_header(None, 0, "", {"continue_final_message": "yes"}, messages)
