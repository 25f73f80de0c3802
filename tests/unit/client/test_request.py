"""The requests the SDK builds from a call's options, without a server (`epd.client.request`):
the Ask header (options on the wire, zeros left to the server, values of the wrong type refused
by their name), a conversation's options, and the Tokenize and Detokenize requests."""

from __future__ import annotations

import json

import pytest

from epd.client.request import (
    build_header,
    check_options,
    conversation,
    detokenize_request,
    tokenize_request,
)
from epd.stages.messages import Message, text


def test_header_carries_options_and_leaves_zeros_to_the_server():
    h = build_header(
        "q?",
        12,
        "ab" * 32,
        {
            "num_frames": 8,
            "max_new_tokens": 16,
            "temperature": 0.0,
            "stop": "END",
            "pruning": "light",
            "pruning_knobs": {"keep": 0.5},
        },
    )
    assert (h.question, h.media_num_bytes, h.media_sha256) == ("q?", 12, "ab" * 32)
    assert h.sampling.num_frames == 8 and h.sampling.fps == 0.0
    assert h.generation.max_new_tokens == 16 and list(h.generation.stop) == ["END"]
    assert h.pruning.preset == "light" and dict(h.pruning.knobs) == {"keep": "0.5"}
    with pytest.raises(TypeError, match=r"unknown options: \['frames'\]"):
        build_header("q?", 0, "", {"frames": 3})
    assert not h.generation.HasField("seed")  # unset: the gateway draws one for a sampled request


def test_a_zero_seed_is_sent_and_zeros_that_mean_something_else_are_refused():
    """seed=0 went out as unset; top_p=0 and max_new_tokens=0 silently became the server's
    defaults (all tokens; 32 tokens)."""
    h = build_header("q?", 0, "", {"seed": 0, "temperature": 1.0})
    assert h.generation.HasField("seed") and h.generation.seed == 0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        build_header("q?", 0, "", {"top_p": 0})
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        build_header("q?", 0, "", {"max_new_tokens": 0})
    with pytest.raises(ValueError, match=r"repetition_penalty must be > 0 \(None: 1, off\)"):
        build_header("q?", 0, "", {"repetition_penalty": 0})


@pytest.mark.parametrize(
    "options,match",
    [
        ({"temperature": -1.0}, r"temperature must be a finite number >= 0 \(0: greedy\), got -1.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"logprobs": -1}, "logprobs must be >= 0, the number of most likely tokens"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be >= 0, the number of most likely tokens"),
    ],
)
def test_a_negative_temperature_or_logprobs_is_refused_before_any_call(options, match):
    """They went out, for the server to refuse (or, a NaN temperature, for the wire to carry):
    the SDK says what to change before any call, as for top_p. Zero and above are sent."""
    with pytest.raises(ValueError, match=match):
        build_header("q?", 0, "", options)
    h = build_header("q?", 0, "", {"temperature": 0.5, "logprobs": 0, "prompt_logprobs": 3})
    assert (h.generation.temperature, h.generation.logprobs, h.generation.prompt_logprobs) == (0.5, 0, 3)
    assert h.generation.HasField("logprobs")


def test_header_carries_vllm_sampling_options():
    h = build_header("q?", 0, "", {
        "repetition_penalty": 1.3, "presence_penalty": -0.5, "frequency_penalty": 0.5, "min_p": 0.05,
        "min_tokens": 3, "logit_bias": {17: 100.0}, "stop_token_ids": [5, 9], "include_stop_str_in_output": True,
    })  # fmt: skip
    g = h.generation
    assert (g.repetition_penalty, g.presence_penalty, g.frequency_penalty, g.min_p, g.min_tokens) == (
        1.3,
        -0.5,
        0.5,
        0.05,
        3,
    )
    assert (
        dict(g.logit_bias) == {17: 100.0}
        and list(g.stop_token_ids) == [5, 9]
        and g.include_stop_str_in_output
    )
    h = build_header("q?", 0, "", {"allowed_token_ids": (4, 17), "bad_words": ["red", " big cat"]})
    assert list(h.generation.allowed_token_ids) == [4, 17] and list(h.generation.bad_words) == [
        "red",
        " big cat",
    ]


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"num_frames": 2.5}, TypeError, r"num_frames must be an integer, got 2.5"),
        ({"max_new_tokens": "4"}, TypeError, r"max_new_tokens must be an integer, got '4'"),
        ({"ignore_eos": "no"}, TypeError, r"ignore_eos must be True or False, got 'no'"),
        ({"stop": 5}, TypeError, r"stop must be a string or a list of strings, got 5"),
        ({"stop": ["a", 5]}, TypeError, r"stop must be a string or a list of strings"),
        ({"stop_token_ids": [1.5]}, TypeError, r"stop_token_ids must be a list of integers"),
        ({"logit_bias": {"x": 1}}, TypeError, r"logit_bias keys must be token ids"),
        ({"logit_bias": {5: "up"}}, TypeError, r"logit_bias must be a dict of integers to numbers"),
        ({"seed": 2**70}, ValueError, r"seed must be an integer of at most 64 bits"),
        ({"allowed_token_ids": [1.5]}, TypeError, r"allowed_token_ids must be a list of integers"),
        # the wire cannot tell an empty list from unset (every token): refused, as the HTTP API's 400
        ({"allowed_token_ids": []}, ValueError, r"allowed_token_ids is empty, which allows no token"),
        # protobuf would have sent each character as a word
        (
            {"bad_words": "red"},
            TypeError,
            r"bad_words must be a list of strings, such as \['red'\], got 'red'",
        ),
        ({"bad_words": ["red", 5]}, TypeError, r"bad_words must be a list of strings"),
        (
            {"stop": ["\ud800"]},
            ValueError,
            r"stop must be a list of strings of valid Unicode \(no lone surrogates\)",
        ),
        ({"pruning": {"preset": "light"}}, TypeError, r'pruning must be a preset name such as "balanced"'),
        ({"cache_salt": 7}, TypeError, r"cache_salt must be a string, got 7"),
    ],
)
def test_an_option_of_the_wrong_type_is_refused_by_its_name(options, error, match):
    """protobuf's own errors ("bad argument type for built-in operation", "'str' object cannot be
    interpreted as an integer") named neither the option nor what it takes."""
    with pytest.raises(error, match=match):
        build_header("q?", 0, "", options)


def test_logit_bias_takes_the_openai_bodys_string_ids_too():
    h = build_header("q?", 0, "", {"logit_bias": {"17": -100, 5: 2.5}})
    assert dict(h.generation.logit_bias) == {17: -100.0, 5: 2.5}


def test_an_empty_conversation_is_refused_before_any_call():
    """It reached the gateway as the 0.1 question form with no question: "the question is empty"."""
    with pytest.raises(ValueError, match="messages is empty"):
        build_header(None, 0, "", {}, messages=[])


def test_a_tokenize_request_carries_its_options_and_leaves_defaults_unset():
    """Unset add_special_tokens and template go as unset, for the server's vLLM defaults."""
    plain = tokenize_request("hi", None, None, None, None, False, "")
    assert (plain.prompt, plain.HasField("add_special_tokens"), plain.HasField("template")) == (
        "hi",
        False,
        False,
    )
    chat = tokenize_request(None, [{"role": "user", "content": "hi"}], True, False, True, True, "r1")
    assert not chat.HasField("prompt") and [m.role for m in chat.messages] == ["user"]
    assert (chat.add_special_tokens, chat.return_token_strs, chat.request_id) == (True, True, "r1")
    assert chat.template.HasField("add_generation_prompt") and not chat.template.add_generation_prompt
    assert chat.template.continue_final_message
    thinking = tokenize_request(
        None, [{"role": "user", "content": "hi"}], None, None, None, False, "", {"enable_thinking": False}
    )
    assert json.loads(thinking.template.chat_template_kwargs_json) == {"enable_thinking": False}
    assert not thinking.template.HasField("chat_template")


def test_the_sdk_sends_a_request_template_as_it_is():
    """vLLM's request `chat_template` (the server decides whether it trusts it); not a str: TypeError."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    header = build_header("what moves?", 0, "", {"chat_template": template})
    assert header.template.chat_template == template and not header.template.HasField("add_generation_prompt")
    counted = tokenize_request(
        None, [{"role": "user", "content": "hi"}], None, None, None, False, "", None, template
    )
    assert counted.template.chat_template == template
    with pytest.raises(TypeError, match="chat_template must be a Jinja template's text"):
        build_header("what moves?", 0, "", {"chat_template": {"default": template}})


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            ("hi", [{"role": "user", "content": "hi"}]),
            TypeError,
            "pass a prompt .* or messages=.*one of them",
        ),
        ((None, None), TypeError, "one of them"),
        ((["hi"], None), TypeError, "prompt must be a string"),
        ((None, []), ValueError, "messages is empty"),
    ],
)
def test_a_bad_tokenize_request_is_refused_before_any_call(args, error, match):
    with pytest.raises(error, match=match):
        tokenize_request(*args, None, None, None, False, "")
    with pytest.raises(TypeError, match="return_token_strs must be True or False"):
        tokenize_request("hi", None, None, None, None, 1, "")


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"request_id": 5}, TypeError, r"request_id must be a string, got 5"),
        ({"pruning_knobs": "keep=0.5"}, TypeError, r"pruning_knobs must be a dict of knob names to values"),
        ({"logit_bias": [17]}, TypeError, r"logit_bias must be a dict of token ids to biases, such as \{1734: -100\}"),
        ({"logit_bias": {True: 1.0}}, TypeError, r"logit_bias keys must be token ids \(int, or a decimal string\)"),
        ({"prompt": [1, True]}, TypeError, r"prompt must be a string or a list of token ids, got \[1, True\]"),
        ({"max_new_tokens": 2**31}, ValueError, r"max_new_tokens must be an integer of at most 32 bits"),
        ({"structured_outputs": {"regex": 5}}, ValueError, r"'structured_outputs\.regex' must be a string"),
    ],
)  # fmt: skip
def test_more_options_of_the_wrong_type_are_refused_by_their_name(options, error, match):
    """A bool is an int to Python and to protobuf: let through, True would go out as token id 1."""
    with pytest.raises(error, match=match):
        build_header(None, 0, "", {"prompt": "once", **options})


def test_options_whose_field_has_presence_send_a_false():
    """skip_special_tokens and spaces_between_special_tokens default to True on the server: a False
    dropped as a proto3 zero would be unset, and answered with the special tokens skipped."""
    g = build_header(
        "q?", 0, "", {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    ).generation
    assert g.HasField("skip_special_tokens") and not g.skip_special_tokens
    assert g.HasField("spaces_between_special_tokens") and not g.spaces_between_special_tokens
    unset = build_header("q?", 0, "", {}).generation
    assert not unset.HasField("skip_special_tokens") and not unset.HasField("spaces_between_special_tokens")


def test_an_empty_stop_string_is_sent_for_the_server_to_refuse():
    """Dropped, the request ran without a stop the caller asked for; the server refuses it as the
    HTTP API does (tests/integration/test_malformed_requests.py)."""
    assert list(build_header("q?", 0, "", {"stop": ""}).generation.stop) == [""]
    assert list(build_header("q?", 0, "", {"stop": ("a", "")}).generation.stop) == ["a", ""]


def test_openais_response_format_becomes_the_structured_outputs():
    """As the HTTP API reads it (`epd.gateway.structured_request`): the same spec on both doors."""
    g = build_header("q?", 0, "", {"response_format": {"type": "json_object"}}).generation
    assert g.structured_outputs.json_object and not g.structured_outputs.json_schema
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    g = build_header("q?", 0, "", {
        "response_format": {"type": "json_schema", "json_schema": {"name": "count", "schema": schema}},
    }).generation  # fmt: skip
    assert json.loads(g.structured_outputs.json_schema) == schema
    assert not build_header("q?", 0, "", {}).generation.HasField("structured_outputs")


def test_a_header_needs_a_question_messages_or_a_prompt():
    with pytest.raises(
        TypeError, match=r"pass a question or messages=\[\.\.\.\], not both \(and not neither\)"
    ):
        build_header(None, 0, "", {})


def test_a_conversation_is_messages_or_chat_form_dicts_in_a_list():
    """A string is a sequence too, and one Message is not a list: each is refused by name."""
    chat = conversation([Message.system("be brief"), {"role": "user", "content": "hi"}])
    assert chat == [Message.system("be brief"), Message.user(text("hi"))]
    for messages in ("hi", Message.user("hi")):
        with pytest.raises(TypeError, match="messages must be a list of Message objects or chat-form dicts"):
            conversation(messages)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="messages must be a list of Message objects"):
            build_header(None, 0, "", {}, messages)  # type: ignore[arg-type]


def test_a_conversations_options_are_checked_when_it_is_made_timeout_s_among_them():
    """An unknown option is refused when the conversation is made, not at its first turn; its
    `timeout_s` is every turn's deadline, not a header option."""
    check_options({"num_frames": 8, "max_new_tokens": 4, "timeout_s": 5.0})
    with pytest.raises(TypeError, match=r"unknown options: \['timeout'\]"):
        check_options({"timeout": 5.0})
    with pytest.raises(TypeError, match="num_frames must be an integer"):
        check_options({"num_frames": "8"})


def test_a_detokenize_request_carries_its_ids_and_refuses_what_is_not_ids():
    request = detokenize_request((5, 0, 17), "r1")
    assert (list(request.token_ids), request.request_id) == ([5, 0, 17], "r1")
    for token_ids in ("abc", b"abc", [1, True], [1.0]):
        with pytest.raises(TypeError, match="token_ids must be a list of token ids \\(integers\\)"):
            detokenize_request(token_ids, "")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_id must be a string, got 7"):
        detokenize_request([1], 7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_ids must be a list of integers of at most 32 bits"):
        detokenize_request([2**31], "")


def test_a_tokenize_request_refuses_a_request_id_that_is_not_a_string():
    with pytest.raises(TypeError, match="request_id must be a string, got 7"):
        tokenize_request("hi", None, None, None, None, False, 7)  # type: ignore[arg-type]


def test_structured_outputs_given_as_epd_asks_merge_with_response_format_as_on_the_http_api():
    """A `StructuredOutputs` (what `epd ask`'s flags build) beside `response_format` is read in the
    HTTP API's form and merged as there (vLLM's): the format's schema replaces the spec's, whose
    options stay; another constraint beside it is two, refused naming both fields. It was refused
    as "'structured_outputs' must be an object"."""
    from epd.model_runtime.sampling import StructuredOutputs

    old, new = {"type": "object"}, {"type": "object", "properties": {"n": {"type": "integer"}}}
    spec = StructuredOutputs(json_schema=json.dumps(old), disable_any_whitespace=True)
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": new}}
    g = build_header("q?", 0, "", {"structured_outputs": spec, "response_format": response_format}).generation
    assert json.loads(g.structured_outputs.json_schema) == new
    assert g.structured_outputs.disable_any_whitespace
    with pytest.raises(ValueError, match="response_format") as refused:
        build_header(
            "q?",
            0,
            "",
            {"structured_outputs": StructuredOutputs(regex="a+"), "response_format": response_format},
        )
    assert "structured_outputs" in str(refused.value)
    choice = StructuredOutputs(choice=("yes", "no"))
    assert list(
        build_header("q?", 0, "", {"structured_outputs": choice}).generation.structured_outputs.choice
    ) == [
        "yes",
        "no",
    ]
