"""The legacy completions body (`POST /v1/completions`) -> the request the chat handler runs: the
prompt's shapes, what is refused with a 400 that says what to send, and the answer's bodies."""

from __future__ import annotations

import pytest

from epd.gateway.ask_types import AskSummary
from epd.gateway.completions_protocol import (
    parse_completion_request,
    text_completion_body,
    text_completion_chunk,
)
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest, NotFound
from epd.stages.raw_prompt import RawPrompt
from epd.video.types import SamplingOptions


def parse(**body):
    return parse_completion_request({"model": "m", **body}, "m", SamplingOptions(), GenerationConfig())


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("once upon", RawPrompt("once upon")),
        (["once upon"], RawPrompt("once upon")),
        ([1, 2, 3], RawPrompt(token_ids=(1, 2, 3))),
        ([[1, 2, 3]], RawPrompt(token_ids=(1, 2, 3))),
        ([1.0, "2", True], RawPrompt(token_ids=(1, 2, 1))),  # vLLM's list[int], pydantic's lax ints
    ],
)
def test_one_prompt_as_text_or_token_ids(prompt, expected):
    request = parse(prompt=prompt, max_tokens=5, stop="\n", stop_token_ids=[7], seed=3, temperature=0.5,
                    allowed_token_ids=[4, 9], bad_words=["red"])  # fmt: skip
    assert request.raw_prompt == expected and request.messages == [] and request.media_url == ""
    assert request.generation.max_new_tokens == 5 and request.generation.stop == ("\n",)
    assert request.generation.stop_token_ids == (7,) and request.generation.seed == 3
    assert request.generation.allowed_token_ids == (4, 9) and request.generation.bad_words == ("red",)
    assert not request.stream and not request.echo


def test_a_token_id_prompt_is_echoed_with_its_text():
    """`echo` with a token-id prompt (lm-evaluation-harness's tokenized requests; it was a 400):
    taken, with `max_tokens` 0 too; what is echoed is the ids' text the front door sets
    (prefill's Detokenize), "" until then."""
    request = parse(prompt=[[1, 2]], echo=True, max_tokens=0, logprobs=1)
    assert request.raw_prompt == RawPrompt(token_ids=(1, 2)) and request.echo and request.echo_only
    assert request.generation.prompt_logprobs == 1 and request.echoed_text == ""
    request.prompt_ids_text = "once upon"
    assert request.echoed_text == "once upon"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"prompt": ["a", "b"]}, "holds 2 prompts; epd answers one prompt per request"),
        ({"prompt": [[1], [2]]}, "holds 2 prompts; epd answers one prompt per request"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt": []}, "the prompt is empty"),
        ({}, "'prompt' must be a string or a list of token ids"),
        ({"prompt": [1, "a"]}, "'prompt' must be a string or a list of token ids"),
        ({"prompt": [1, -2]}, r"'prompt\[\]' must be an integer from 0"),
        ({"prompt": [1.5]}, "'prompt' must be a string or a list of token ids"),
        ({"prompt": "a", "logprobs": -1}, "'logprobs' must be an integer from 0 to"),
        ({"prompt": "a", "logprobs": 1.5}, "'logprobs' must be an integer"),
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "'prompt_logprobs' is not available with"),
        ({"prompt": "a", "prompt_logprobs": -1}, "'prompt_logprobs' must be an integer from 0 to"),
        ({"prompt": "a", "suffix": "end"}, "'suffix' is not supported by this server"),
        ({"prompt": "a", "n": 17}, "'n' must be an integer from 1 to 16 "),
        ({"prompt": "a", "best_of": 2}, "'best_of' is not supported"),
        ({"prompt": "a", "add_special_tokens": False}, "'add_special_tokens' is not supported"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options only goes with"),
    ],
)
def test_what_is_refused_says_what_to_send(body, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(**body)


def test_chat_only_fields_are_logged_as_ignored(caplog):
    """vLLM's completions request has no top_logprobs (its logprobs is the count of alternatives)
    and no chat template options: ignored, as vLLM ignores unknown fields, and logged."""
    with caplog.at_level("WARNING", logger="epd.gateway.request_fields"):
        request = parse(prompt="a", logprobs=2, top_logprobs=5, chat_template_kwargs={})
    assert request.generation.logprobs == 2
    assert "ignored request fields ['chat_template_kwargs', 'top_logprobs']" in caplog.text


def test_another_model_is_not_found():
    with pytest.raises(NotFound, match="GET /v1/models lists 'm'"):
        parse_completion_request(
            {"model": "other", "prompt": "a"}, "m", SamplingOptions(), GenerationConfig()
        )


def test_streaming_echo_and_usage_options():
    request = parse(
        prompt="a",
        stream=True,
        echo=True,
        add_special_tokens=True,
        suffix=None,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    assert request.stream and request.echo and request.include_usage and request.continuous_usage
    # With logprobs, the echo asks for the prompt's too, streamed in each choice's first chunk (it was a 400).
    request = parse(prompt="a", stream=True, echo=True, logprobs=2)
    assert (request.generation.logprobs, request.generation.prompt_logprobs) == (2, 2)


def test_the_answer_is_a_text_completion_with_its_stop_reason():
    summary = AskSummary("r1", " there", [5, 6], "stop", 0, 0, 3, {}, 0, False, "", [], stop_reason="\n")
    body = text_completion_body(summary, parse(prompt="hi", echo=True, return_token_ids=True), created=1)
    assert body["id"] == "cmpl-r1" and body["object"] == "text_completion" and body["model"] == "m"
    assert body["choices"] == [
        {
            "index": 0,
            "text": "hi there",
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": "\n",
            "token_ids": [5, 6],
            "prompt_logprobs": None,  # vLLM's, when asked
            "prompt_token_ids": None,  # vLLM's, when asked (this summary has none)
        }
    ]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2
    assert body["epd"]["stop_reason"] == "\n"
    chunk = text_completion_chunk("r1", "m", 1, "", "stop", stop_reason=7)
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["stop_reason"] == 7


def test_grpc_and_the_sdk_send_a_raw_prompt_alone():
    """`AskHeader.prompt` (the SDK's `prompt=`) goes instead of messages or a question, not beside."""
    from epd.client import build_header
    from epd.gateway.servicer import raw_prompt_of
    from epd.stages.messages import Message
    from epd.transport import convert
    from epd.v1 import gateway_pb2, messages_pb2

    assert raw_prompt_of(build_header(None, 0, "", {"prompt": "once"})) == RawPrompt("once")
    assert raw_prompt_of(build_header(None, 0, "", {"prompt": [1, 2]})) == RawPrompt(token_ids=(1, 2))
    assert raw_prompt_of(gateway_pb2.AskHeader(question="why?")) is None
    for header in (
        gateway_pb2.AskHeader(prompt=messages_pb2.RawPrompt(text="a"), question="why?"),
        gateway_pb2.AskHeader(
            prompt=messages_pb2.RawPrompt(text="a"), messages=convert.messages_to_proto([Message.user("hi")])
        ),
    ):
        with pytest.raises(
            InvalidRequest, match="send a raw prompt, messages or a question, only one of them"
        ):
            raw_prompt_of(header)
    with pytest.raises(TypeError, match="pass a prompt, a question or messages"):
        build_header("q", 0, "", {"prompt": "once"})
    with pytest.raises(TypeError, match="prompt must be a string or a list of token ids"):
        build_header(None, 0, "", {"prompt": 5})


def test_echo_with_max_tokens_0_answers_the_prompt_alone():
    """vLLM's echo without generation (lm-evaluation-harness's loglikelihood requests): max_tokens 0
    with echo was a 400 ("must be an integer from 1"). One token is generated, as vLLM's, and the
    answer is the prompt's text and its logprobs alone; without echo, 0 is still a 400."""
    from epd.model_runtime.logprobs import TokenLogprob

    request = parse(prompt="hi", echo=True, max_tokens=0, logprobs=1)
    assert request.echo_only and request.generation.max_new_tokens == 1
    assert request.generation.prompt_logprobs == 1  # the prompt's, as echo with logprobs asks
    prompt = [TokenLogprob(3, "h", 0.0), TokenLogprob(4, "i", -1.5)]
    summary = AskSummary(
        "r1", " x", [9], "length", 0, 0, 2, {}, 0, False, "", [],
        logprobs=[TokenLogprob(9, " x", -0.5)], prompt_logprobs=prompt,
    )  # fmt: skip
    choice = text_completion_body(summary, request, created=1)["choices"][0]
    assert choice["text"] == "hi" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["h", "i"]
    assert not parse(prompt="hi", echo=True, max_tokens=1).echo_only
    for zero in (0.0, "0", False):  # 0 as vLLM's lax int reads it
        assert parse(prompt="hi", echo=True, max_tokens=zero).echo_only
    for body in ({"max_tokens": 0}, {"max_tokens": False}, {"max_tokens": "0"}):
        with pytest.raises(InvalidRequest, match="'max_tokens' must be an integer from 1"):
            parse(prompt="hi", **body)
