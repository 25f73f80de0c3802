"""vLLM's `echo` on chat completions: the answer's content begins with the last message's when
that message's role is the answer's (`ChatRequest.response_role`), so that `continue_final_message`
with `echo` gives back the whole assistant message; a media part in the echoed message is a 400;
usage counts the generated tokens alone. Through the real processes:
tests/integration/test_chat_echo.py."""

from __future__ import annotations

import pytest

from epd.client import build_header
from epd.gateway.ask_types import AskSummary
from epd.gateway.chat_answer import UNSET_MESSAGE_FIELDS, completion_body
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.completions_protocol import parse_completion_request
from epd.gateway.http_errors import http_status_of
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.transport.errors import status_of
from epd.video.types import SamplingOptions

NO_REASONING = {"reasoning": None, "reasoning_content": None}  # vLLM's null without a parser

MODEL = "epd"
QUESTION = {"role": "user", "content": "name a colour"}
STARTED = {"role": "assistant", "content": "The colour is"}
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
VIDEO = {"type": "video_url", "video_url": {"url": "data:x"}}
VIDEO_QUESTION = {"role": "user", "content": [VIDEO, {"type": "text", "text": "what?"}]}
SPLIT = {
    "role": "assistant",
    "content": [{"type": "text", "text": "The"}, {"type": "text", "text": "colour"}],
}


def parse(**body):
    return parse_chat_request(
        {"model": MODEL, "echo": True, **body}, MODEL, SamplingOptions(), GenerationConfig(max_new_tokens=8)
    )


def summary(answer: str = " red", token_ids: tuple[int, ...] = (5, 6)) -> AskSummary:
    return AskSummary("r1", answer, list(token_ids), "stop", 0, 0, 3, {}, 0, False, "", [])


@pytest.mark.parametrize(
    "body,role,echoed",
    [
        # The continued assistant message: the whole message comes back.
        ({"messages": [QUESTION, STARTED], **CONTINUE}, "assistant", "The colour is"),
        # The defaults, the user's message last: the answer is the assistant's, nothing to echo.
        ({"messages": [QUESTION]}, "assistant", ""),
        # The defaults after an assistant's message: a new assistant answer, that message echoed (vLLM's).
        ({"messages": [QUESTION, STARTED]}, "assistant", "The colour is"),
        # No generation prompt: the model writes on in the user's turn, whose text is echoed.
        ({"messages": [QUESTION], "add_generation_prompt": False}, "user", "name a colour"),
        # Text parts joined with "\n", as vLLM joins them.
        ({"messages": [QUESTION, SPLIT], **CONTINUE}, "assistant", "The\ncolour"),
        # A media part in an earlier message is not echoed, and does not stop the echo.
        ({"messages": [VIDEO_QUESTION, STARTED], **CONTINUE}, "assistant", "The colour is"),
        ({"messages": [VIDEO_QUESTION]}, "assistant", ""),
        # echo false (or null): nothing in front.
        ({"messages": [QUESTION, STARTED], **CONTINUE, "echo": False}, "assistant", ""),
        ({"messages": [QUESTION, STARTED], **CONTINUE, "echo": None}, "assistant", ""),
    ],
)
def test_the_echoed_text_is_the_last_messages_when_its_role_is_the_answers(body, role, echoed):
    request = parse(**body)
    assert (request.response_role, request.echoed_text) == (role, echoed)
    whole = completion_body(
        summary(), MODEL, role=request.response_role, echoed=request.echoed_text, return_token_ids=True
    )
    assert whole["choices"][0]["message"] == {
        "role": role,
        "content": echoed + " red",
        **UNSET_MESSAGE_FIELDS,
        **NO_REASONING,
    }
    # Usage and the token ids are the generated ones alone, as vLLM's.
    assert whole["usage"]["completion_tokens"] == 2 and whole["choices"][0]["token_ids"] == [5, 6]
    assert whole["epd"]["token_ids"] == [5, 6]


def test_a_media_part_in_the_echoed_message_is_a_400_saying_what_to_change():
    with pytest.raises(
        InvalidRequest, match="the last message holds a video, which has no text to echo"
    ) as info:
        parse(
            messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, VIDEO]}],
            add_generation_prompt=False,
        )
    assert "leave 'echo' unset or false" in str(info.value)
    assert http_status_of(status_of(info.value)[0])[0] == 400


def test_echo_must_be_a_boolean_and_a_raw_prompts_echo_still_works():
    # vLLM's bool, read as pydantic reads one: "yes" and 1 are true (they were 400s here)
    assert parse(messages=[QUESTION], echo="yes").echo is parse(messages=[QUESTION], echo=1).echo is True
    with pytest.raises(InvalidRequest, match="'echo' must be true or false, got 'sometimes'"):
        parse(messages=[QUESTION], echo="sometimes")
    raw = parse_completion_request(
        {"model": MODEL, "prompt": "hi", "echo": True}, MODEL, SamplingOptions(), GenerationConfig()
    )
    assert raw.echoed_text == "hi"


def test_the_sdk_and_grpc_have_no_echo():
    """Echo is presentation, HTTP's alone as in vLLM (whose only doors are HTTP): the SDK's caller
    holds the message it sent, and gRPC's answer (`AskSummary.answer`, the SDK's `AskResult.answer`)
    is the generated text, as its token ids are. Asked of the SDK, it is refused by name."""
    with pytest.raises(TypeError, match=r"unknown options: \['echo'\]"):
        build_header(None, 0, "", {"echo": True}, [QUESTION, STARTED])
