"""The message model (epd.stages.messages): its rules, its chat-template form, its one wire
converter, and the gRPC door's deprecated question."""

from __future__ import annotations

import pytest

from epd.gateway.servicer import messages_of
from epd.stages.errors import InvalidRequest
from epd.stages.messages import (
    IMAGE,
    MAX_PARTS,
    VIDEO,
    Message,
    ToolCall,
    check_messages,
    from_chat_template,
    num_text_chars,
    question_messages,
    text,
    to_chat_template,
)
from epd.transport import convert
from epd.v1 import gateway_pb2

HISTORY = [
    Message.system("be brief"),
    Message.user("look:", VIDEO, "what moves?"),
    Message.assistant("a circle"),
    Message.user("and then?"),
]


def test_chat_template_form_keeps_the_order_and_types_the_media_by_the_encoded_modality():
    form = to_chat_template(HISTORY, "image")
    assert form[1] == {"role": "user", "content": [
        {"type": "text", "text": "look:"}, {"type": "image"}, {"type": "text", "text": "what moves?"}]}  # fmt: skip
    assert form[0] == {"role": "system", "content": [{"type": "text", "text": "be brief"}]}
    assert from_chat_template(to_chat_template(HISTORY, "video")) == HISTORY


def test_the_wire_form_round_trips():
    assert convert.messages_from_proto(convert.messages_to_proto(HISTORY)) == HISTORY


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "no messages"),
        ([Message.user(VIDEO, "a", IMAGE)], "2 video or image parts; at most one video or image per request"),
        ([Message.user(VIDEO, "q"), Message.system("a")], "end with the user's message"),
        ([Message("bot", (VIDEO,))], "role 'bot'"),
        ([Message("assistant", (VIDEO,)), Message.user("q")], "media go in user messages"),
    ],
)
def test_check_messages_says_what_to_change(messages, match):
    with pytest.raises(InvalidRequest, match=match):
        check_messages(messages)


def test_a_conversation_may_have_no_media_but_never_two_nor_media_outside_a_user_message():
    """Text alone (a "hello", a health ping, a title request) is a conversation, as vLLM answers
    one on a vision-language model; a second media part and media in a system or assistant
    message are refused, saying what to change."""
    check_messages([Message.user("hello")])
    check_messages(
        [Message.system("be brief"), Message.user("hi"), Message.assistant("hello"), Message.user("?")]
    )
    with pytest.raises(
        InvalidRequest,
        match=r"2 video or image parts; at most one video or image per request is "
        r"supported \(the encoder encodes one media per request\): send one",
    ):
        check_messages(
            [Message.user(VIDEO, "compare"), Message.assistant("ok"), Message.user(IMAGE, "with this")]
        )
    for role in ("system", "assistant"):
        with pytest.raises(
            InvalidRequest,
            match=f"messages\\[0\\] is a {role} message with a video part; media go in user messages",
        ):
            check_messages([Message(role, (VIDEO,)), Message.user("q")])


def test_a_conversation_may_be_the_media_alone_but_a_question_may_not_be_blank():
    """As in vLLM and OpenAI's API, a user message may hold only the video; the question form
    (gRPC's deprecated `question`, the SDK's `ask(video, question)`) asks a question."""
    check_messages([Message.user(VIDEO)])
    check_messages([Message.system("describe what you see"), Message.user(VIDEO, "  ")])
    for blank in ("", "  \n"):
        with pytest.raises(InvalidRequest, match="the question is empty; ask something about the video"):
            question_messages(blank)
        with pytest.raises(InvalidRequest, match="the question is empty"):
            messages_of(gateway_pb2.AskHeader(question=blank), media_sent=True)


def test_check_messages_limits_the_text():
    check_messages(HISTORY, max_text_chars=100)
    with pytest.raises(InvalidRequest, match="characters of text; the limit is 10"):
        check_messages(HISTORY, max_text_chars=10)


def test_the_text_limit_counts_call_ids_and_arguments():
    """A tool message's tool_call_id and a call's id are text the chat template may render, as the
    call's arguments are: a long one is held to the limit too."""
    call = ToolCall("c" * 40, "get_weather", '{"city": "Paris"}')
    history = [
        Message.user("weather?"),
        Message("assistant", (text(""),), (call,)),
        Message("tool", (text("sunny"),), tool_call_id="t" * 50),
    ]
    assert num_text_chars(history) == len("weather?") + 40 + len('{"city": "Paris"}') + len("sunny") + 50
    with pytest.raises(InvalidRequest, match="characters of text; the limit is 100"):
        check_messages(history, max_text_chars=100)


def test_check_messages_limits_the_parts():
    """Many tiny messages under the text limit: refused before the media costs an encode."""
    turns = [Message.assistant("a"), Message.user("a")] * 1024
    many = [Message.user(VIDEO, "q"), *turns]  # 2 + 2,048 parts
    check_messages(many[:-2])  # 2,048 parts: the limit
    with pytest.raises(InvalidRequest, match=f"2050 content parts; the limit is {MAX_PARTS}"):
        check_messages(many, max_text_chars=10**6)


def test_the_deprecated_question_is_one_user_message_media_then_text():
    assert messages_of(gateway_pb2.AskHeader(question="why?"), media_sent=True) == [
        Message.user(VIDEO, "why?")
    ]
    assert messages_of(gateway_pb2.AskHeader(question="why?"), media_sent=True) == question_messages("why?")
    header = gateway_pb2.AskHeader(messages=convert.messages_to_proto(HISTORY))
    assert messages_of(header, media_sent=True) == HISTORY
    header.question = "why?"
    with pytest.raises(InvalidRequest, match="not both"):
        messages_of(header, media_sent=True)


def test_the_deprecated_question_without_media_says_to_send_messages():
    """The question form is a question about the media: with none sent it is refused, naming the
    text-only form, not read as text alone nor passed on to the encoder's "the media is empty"."""
    with pytest.raises(InvalidRequest, match=r"none was sent: send the video or image .* send messages = "):
        messages_of(gateway_pb2.AskHeader(question="why?"), media_sent=False)
    text_only = gateway_pb2.AskHeader(messages=convert.messages_to_proto([Message.user("why?")]))
    assert messages_of(text_only, media_sent=False) == [Message.user("why?")]


def test_the_sdk_sends_messages_or_the_deprecated_question():
    from epd.client import build_header

    header = build_header(
        None,
        3,
        "",
        {},
        messages=[
            Message.system("be brief"),
            {"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "video"}]},
        ],
    )
    assert convert.messages_from_proto(header.messages) == [
        Message.system("be brief"),
        Message.user("q", VIDEO),
    ]
    assert header.question == ""
    assert build_header("q", 3, "", {}).question == "q" and not build_header("q", 3, "", {}).messages
    with pytest.raises(TypeError, match="not both"):
        build_header("q", 3, "", {}, messages=[Message.user(VIDEO, "q")])
