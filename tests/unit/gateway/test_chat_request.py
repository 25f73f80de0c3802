"""Chat-completions bodies -> the pipeline's request (`epd.gateway.chat_request`)."""

from __future__ import annotations

import re

import pytest

from epd.gateway.chat_request import parse_chat_request
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest, NotFound
from epd.stages.messages import IMAGE, VIDEO, Message
from epd.video.types import SamplingOptions

MODEL = "epd"


def body(**overrides):
    content = [
        {"type": "text", "text": "what happens?"},
        {"type": "video_url", "video_url": {"url": "data:x"}},
    ]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **overrides}


def parse(b):
    return parse_chat_request(b, MODEL, SamplingOptions(), GenerationConfig(max_new_tokens=32))


def test_defaults_and_options():
    req = parse(body())
    assert (req.messages, req.media_url, req.modality, req.stream) == (
        [Message.user("what happens?", VIDEO)],
        "data:x",
        "video",
        False,
    )
    # max_tokens unset: the default, which prefill fits to what the context leaves (vLLM's default)
    assert req.generation == GenerationConfig(max_new_tokens=32, fit_max_new_tokens=True)
    assert req.sampling == SamplingOptions()

    req = parse(
        body(
            max_tokens=5, temperature=0.7, top_p=0.9, top_k=4, seed=3, stop="END", stream=True,
            stream_options={"include_usage": True}, media={"num_frames": 8, "max_frames": 16},
        )
    )  # fmt: skip
    assert req.generation == GenerationConfig(
        max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=4, seed=3, stop=("END",)
    )
    assert (req.sampling.num_frames, req.sampling.max_frames) == (8, 16)
    assert parse(body(media={"fps": 1, "max_frames": 16})).sampling == SamplingOptions(fps=1.0, max_frames=16)
    assert req.stream and req.include_usage
    assert parse(body(max_completion_tokens=7, max_tokens=5)).generation.max_new_tokens == 7


def test_a_conversation_without_media_is_text_alone():
    """A string content and no media part (LiteLLM's health check, a client's "hello"): no URL,
    no modality; the media and pruning options are still checked."""
    req = parse({"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "ping"}],
                 "media": {"num_frames": 4}, "pruning": {"preset": "balanced"}})  # fmt: skip
    assert (req.messages, req.media_url, req.modality) == (
        [Message.system("be brief"), Message.user("ping")],
        "",
        "",
    )
    with pytest.raises(InvalidRequest, match="unknown media options"):
        parse({"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "media": {"frames": 4}})


def test_image_part_and_string_url():
    b = body()
    b["messages"][0]["content"][1] = {"type": "image_url", "image_url": "data:y"}
    req = parse(b)
    assert (req.media_url, req.modality) == ("data:y", "image")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "function", "content": "x"}]}, "roles must be system, user, assistant, tool"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "video_url", "video_url": {"url": "data:x"}},
                            {"type": "image_url", "image_url": {"url": "data:y"}},
                        ],
                    }
                ]
            },
            "have 2 video_url / image_url parts; at most one video or image per request",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "video_url", "video_url": {"url": "data:x"}}]},
                    {"role": "user", "content": "and?"},
                ]
            },
            "put the video_url part in a user message",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "video_url", "video_url": {"url": "data:x"}},
                            {"type": "text", "text": "what?"},
                        ],
                    },
                    {"role": "system", "content": "red"},
                ]
            },
            "end with the user's message",
        ),
        ({"echo": 2}, "'echo' must be true or false, got 2"),
        ({"messages": [{"role": "user", "content": []}]}, "non-empty list of content parts"),
        ({"media": {"frames": 3}}, "unknown media options"),
        ({"media": {"num_frames": [8]}}, "'num_frames' must be an integer"),
        ({"max_tokens": "9.5"}, "'max_tokens' must be an integer"),
        ({"max_tokens": 0}, "'max_tokens' must be an integer from 1 to 2147483647, got 0"),
        ({"top_p": 0}, "'top_p' must be a finite number > 0 and <= 1, got 0"),
        ({"stop": [1]}, "list of strings"),
        ({"stop": [str(i) for i in range(33)]}, "'stop': stop has 33 strings; at most 32 are accepted"),
        ({"stop": "x" * 513}, "'stop': a stop string has 513 characters; at most 512 are accepted"),
        (
            {"n": 17},
            r"'n' must be an integer from 1 to 16 \(choices per request\), got 17; send more requests",
        ),
        ({"n": 0}, "'n' must be an integer from 1 to 16"),
        ({"n": 2.5}, "'n' must be an integer from 1 to 16"),
        ({"logprobs": False, "top_logprobs": 3}, "'top_logprobs' .3. needs \"logprobs\": true"),
        ({"top_logprobs": 1}, 'needs "logprobs": true'),
        ({"logprobs": True, "top_logprobs": -1}, "'top_logprobs' must be an integer from 0 to"),
        ({"logprobs": True, "top_logprobs": 2.5}, "'top_logprobs' must be an integer"),
        ({"logprobs": "yes please"}, "'logprobs' must be"),
    ],
)
def test_invalid_bodies(change, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(body(**change))


def test_two_media_parts_and_unknown_parts():
    b = body()
    b["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "data:z"}})
    with pytest.raises(
        InvalidRequest, match="have 2 video_url / image_url parts; at most one video or image"
    ):
        parse(b)
    b = body()
    b["messages"][0]["content"].append({"type": "input_audio", "input_audio": {}})
    with pytest.raises(InvalidRequest, match="unsupported content part 'input_audio'"):
        parse(b)


def test_a_text_part_without_string_text_says_so():
    """It was "unsupported content part 'text'; use 'text', ...": the type named as the fix."""
    for part in ({"type": "text"}, {"type": "text", "text": 5}):
        b = body()
        b["messages"][0]["content"].append(part)
        with pytest.raises(InvalidRequest, match=r"a text part of messages\[0\] needs its text"):
            parse(b)


def test_the_part_spellings_vllms_chat_reads_too():
    """vLLM's chat reads the Responses API's input_text / output_text / input_image parts, a
    refusal part as text, and a media part without "type" (`_parse_chat_message_content_mm_part`):
    each was a 400 ("unsupported content part")."""
    messages = [
        {"role": "system", "content": [{"type": "input_text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:i"}, {"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    req = parse({"model": MODEL, "messages": messages})
    assert (req.media_url, req.modality) == ("data:i", "image")
    assert req.messages[:2] == [Message.system("be brief"), Message.user(IMAGE, "q")]
    assert [(p.type, p.text) for p in req.messages[2].parts] == [("text", "a"), ("text", "no")]
    for part, url, modality in (
        ({"video_url": {"url": "data:v"}}, "data:v", "video"),
        ({"image_url": "data:w"}, "data:w", "image"),
    ):
        req = parse({"model": MODEL, "messages": [{"role": "user", "content": [part]}]})
        assert (req.media_url, req.modality) == (url, modality)
    with pytest.raises(InvalidRequest, match=r"a refusal part of messages\[0\] needs its text"):
        parse({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "refusal", "text": "x"}]}]})
    with pytest.raises(InvalidRequest, match="unsupported content part None"):
        parse({"model": MODEL, "messages": [{"role": "user", "content": [{"audio_url": "x"}]}]})


def test_an_earlier_turn_with_a_deprecated_function_call_is_refused_not_dropped():
    """An assistant turn of a call (content null) was taken as an empty answer: the model saw
    a conversation in which it had said nothing. OpenAI's deprecated `function_call` is still
    refused (its `tool_calls` are rendered: tests/unit/gateway/test_tool_request.py)."""
    b = body()
    b["messages"] += [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "user", "content": "and?"},
    ]
    with pytest.raises(InvalidRequest, match=r"messages\[1\] has 'function_call', OpenAI's deprecated form"):
        parse(b)
    b["messages"][1]["function_call"] = None  # asks for nothing
    assert parse(b).messages[1] == Message.assistant("")


def test_unknown_model_is_not_found():
    with pytest.raises(NotFound, match="GET /v1/models lists 'epd'"):
        parse(body(model="gpt-4o"))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"media": {"fps": NAN}}, "'fps' must be a finite number > 0 and <= 1000, got nan"),
        ({"media": {"fps": INF}}, "'fps' must be a finite number > 0 and <= 1000, got inf"),
        ({"media": {"fps": 0}}, "'fps' must be a finite number > 0"),
        ({"media": {"fps": 1e308}}, "'fps' must be a finite number > 0 and <= 1000, got 1e+308"),
        ({"media": {"start_time_s": NAN}}, "'start_time_s' must be a finite number >= 0"),
        ({"media": {"start_time_s": -INF}}, "'start_time_s' must be a finite number >= 0"),
        ({"media": {"end_time_s": INF}}, "'end_time_s' must be a finite number > 0"),
        ({"media": {"fps": 10**400}}, "'fps' must be a finite number > 0 and <= 1000, got a huge integer"),
        ({"media": {"num_frames": 2**40}}, "'num_frames' must be an integer from 1 to 2147483647"),
        ({"media": {"num_frames": 8.5}}, "'num_frames' must be an integer"),
        ({"media": {"max_pixels": 2**63}}, "'max_pixels' must be an integer from 1 to"),
        ({"temperature": NAN}, "'temperature' must be a finite number >= 0, got nan"),
        ({"temperature": -0.5}, "'temperature' must be a finite number >= 0"),
        ({"top_p": NAN}, "'top_p' must be a finite number > 0 and <= 1"),
        ({"max_tokens": 2**40}, "'max_tokens' must be an integer from 1 to 2147483647"),
        ({"max_completion_tokens": 2**31}, "'max_completion_tokens' must be an integer"),
        ({"top_k": 2**40}, "'top_k' must be an integer from -1 to 2147483647"),
        ({"seed": 2**63}, "'seed' must be an integer from -9223372036854775808 to 9223372036854775807"),
        ({"seed": 10**100}, "got a huge integer"),
        ({"stream": "streamed"}, "'stream' must be true or false"),
        (
            {"stream": True, "stream_options": {"include_usage": 0.5}},
            "'stream_options.include_usage' must be true or false",
        ),
        ({"ignore_eos": -1}, "'ignore_eos' must be true or false"),
        ({"n": "two"}, "'n' must be an integer from 1 to 16"),
        ({"model": ["epd"]}, "'model' must be a string"),
        ({"stop": "\ud800"}, "'stop' is not valid Unicode text"),
        ({"pruning": {"preset": 3}}, "pruning.preset must be a string"),
        (
            {"pruning": {"knobs": {"kv_keep_ratio": NAN}}},
            "pruning option kv_keep_ratio='nan' is not a valid float",
        ),
        ({"pruning": {"knobs": {"prefill_drop_layer": 2**70}}}, "is not a valid int"),
        ({"pruning": {"knobs": {"kv_keep_ratio": [0.5]}}}, "pruning.knobs.kv_keep_ratio must be a number"),
    ],
)
def test_out_of_range_and_non_finite_fields_name_the_field(change, match):
    with pytest.raises(InvalidRequest, match=re.escape(match)):
        parse(body(**change))


def test_text_that_cannot_be_utf8_is_refused():
    b = body()
    b["messages"][0]["content"][0]["text"] = "what \ud800 happens?"
    with pytest.raises(InvalidRequest, match="'messages\\[0\\].content\\[0\\].text' is not valid Unicode"):
        parse(b)
    b = body()
    b["messages"][0]["content"] = "what \ud800 happens?"  # the content a string: named as such
    with pytest.raises(InvalidRequest, match="'messages\\[0\\].content' is not valid Unicode"):
        parse(b)
    b = body()
    b["messages"][0]["content"][1]["video_url"]["url"] = "/videos/\udcff.mp4"
    with pytest.raises(InvalidRequest, match="'video_url.url' is not valid Unicode"):
        parse(b)


def test_values_at_the_ends_of_their_ranges_are_accepted():
    req = parse(
        body(max_tokens=2**31 - 1, top_k=2**31 - 1, seed=-(2**63), temperature=0, top_p=1,
             media={"num_frames": 2**31 - 1, "max_pixels": 2**63 - 1, "start_time_s": 0, "end_time_s": 1e9})
    )  # fmt: skip
    assert (req.generation.max_new_tokens, req.generation.seed, req.sampling.max_pixels) == (
        2**31 - 1,
        -(2**63),
        2**63 - 1,
    )
    assert parse(body(seed=2**40)).generation.seed == 2**40


@pytest.mark.parametrize("name", ["max_tokens", "top_k", "seed"])
def test_integers_past_floats_range_are_refused_not_raised(name):
    with pytest.raises(InvalidRequest, match=f"'{name}' must be an integer from .* got a huge integer"):
        parse(body(**{name: 10**400}))


def test_deeply_nested_values_are_named_not_echoed():
    nested: list = []
    for _ in range(900):
        nested = [nested]
    with pytest.raises(InvalidRequest, match="'seed' must be an integer .* got an array"):
        parse(body(seed=nested))
    with pytest.raises(InvalidRequest, match=r"got roles \[None\]"):
        parse(body(messages=[{"role": nested}]))


def test_parts_keep_the_clients_order_and_history_is_kept():
    """[text, video_url, text] stays in that order (no joining, no media first), with the
    system and assistant turns before it."""
    url = {"url": "data:x"}
    req = parse(body(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": url}, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a circle"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]))  # fmt: skip
    assert req.messages == [
        Message.system("be brief"), Message.user(IMAGE, "what?"), Message.assistant("a circle"),
        Message.user("a", "b"),
    ]  # fmt: skip
    assert (req.media_url, req.modality) == ("data:x", "image")
    req = parse(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look:"}, {"type": "video_url", "video_url": url}, {"type": "text", "text": "why?"},
    ]}]))  # fmt: skip
    assert req.messages == [Message.user("look:", VIDEO, "why?")]


@pytest.mark.parametrize(("field", "value"), [
    ("best_of", 2), ("use_beam_search", True), ("length_penalty", 0.5), ("guided_whitespace_pattern", "\\s*"),
    ("functions", [{"name": "f"}]), ("function_call", "required"),
    ("best_of", "2"), ("use_beam_search", "yes"),  # vLLM's int and bool, read as it reads them
    # vLLM's fields that change the prompt, the frames or the answer's text: they were logged as
    # unknown, and answered as if they had not been sent.
    ("add_special_tokens", True),
    ("mm_processor_kwargs", {"fps": 1}), ("truncate_prompt_tokens", 16), ("documents", [{"text": "d"}]),
    ("logits_processors", ["x.Y"]), ("vllm_xargs", {"a": 1}),
    # vLLM's too, logged as unknown and answered as if not sent: the frames vLLM loads, a model's
    # thinking, an answer ended early or watermarked, the rendered prompt asked back.
    ("media_io_kwargs", {"video": {"num_frames": 16}}), ("reasoning_effort", "none"),
    ("thinking_token_budget", 64), ("repetition_detection", {"max_pattern_size": 8}), ("watermarking", True),
    ("return_prompt_text", True),
    # vLLM's earlier form of repetition_detection (0 is off), not ignored either.
    ("max_repetition_pattern_size", 8), ("min_repetition_pattern_size", 2), ("repetition_min_count", 3),
])  # fmt: skip
def test_a_field_this_server_does_not_implement_is_refused_not_ignored(field, value):
    """They were answered 200 as if they had not been sent (the biased tokens still came)."""
    with pytest.raises(InvalidRequest, match=f"'{field}' is not supported by this server; leave it unset"):
        parse(body(**{field: value}))


def test_the_values_of_those_fields_that_ask_for_nothing_are_accepted(caplog):
    neutral = dict(
        frequency_penalty=0,
        presence_penalty=0.0,
        repetition_penalty=1,
        logit_bias={},
        min_tokens=0,
        min_p=0,
        stop_token_ids=[],
        include_stop_str_in_output=False,
        allowed_token_ids=None,
        bad_words=[],
        best_of=1,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        guided_json=None,
        add_special_tokens=False,
        chat_template=None,
        mm_processor_kwargs={},
        priority=0,
        media_io_kwargs={},
        include_reasoning=True,
        watermarking=False,
        return_prompt_text=False,
        reasoning_effort=None,
        max_repetition_pattern_size=0,  # vLLM's default: no repetition check
        min_repetition_pattern_size=0,
        repetition_min_count=0,
    )
    assert parse(body(**neutral)).generation == GenerationConfig(max_new_tokens=32, fit_max_new_tokens=True)
    with caplog.at_level("WARNING", logger="epd.gateway.request_fields"):
        parse(body(medias={"num_frames": 4}, user="u1", return_token_ids=True))
    # A typo is logged; OpenAI's `user` is known, and so is vLLM's `return_token_ids` (the choices
    # carry the answer's token ids always).
    assert "ignored request fields ['medias']" in caplog.text


@pytest.mark.parametrize("field", ["mm_processor_kwargs", "media_io_kwargs"])
def test_vllms_ways_to_ask_for_frames_are_refused_with_where_frames_go(field):
    """vLLM's clients ask for frames in these; the refusal said only "leave it unset"."""
    value = {"fps": 1} if field == "mm_processor_kwargs" else {"video": {"num_frames": 16}}
    with pytest.raises(
        InvalidRequest,
        match=f"'{field}' is not supported .*; frame sampling goes in \"media\": "
        r'\{"num_frames": 8\}',
    ):
        parse(body(**{field: value}))


def test_vllm_sampling_options_are_read_with_vllm_meanings():
    """They were 400s ('not supported'); vLLM and SGLang clients send them."""
    req = parse(body(
        repetition_penalty=1.2, presence_penalty=-1, frequency_penalty=0.5, min_p=0.1, min_tokens=4,
        logit_bias={"17": 100, "5": -2.5}, stop_token_ids=[7, 3], include_stop_str_in_output=True,
        allowed_token_ids=[9, 17, 5], bad_words=["red", " big cat"],
    ))  # fmt: skip
    assert req.generation == GenerationConfig(
        max_new_tokens=32,
        repetition_penalty=1.2,
        presence_penalty=-1.0,
        frequency_penalty=0.5,
        min_p=0.1,
        min_tokens=4,
        logit_bias=((5, -2.5), (17, 100.0)),
        stop_token_ids=(7, 3),
        include_stop_str_in_output=True,
        allowed_token_ids=(9, 17, 5),
        bad_words=("red", " big cat"),
        fit_max_new_tokens=True,
    )


@pytest.mark.parametrize(("fields", "match"), [
    ({"repetition_penalty": 0}, r"'repetition_penalty' must be a finite number > 0, got 0"),
    ({"presence_penalty": 2.5}, r"'presence_penalty' must be a finite number >= -2 and <= 2, got 2.5"),
    ({"frequency_penalty": "3"}, r"'frequency_penalty' must be a finite number >= -2 and <= 2, got '3'"),
    ({"frequency_penalty": "one"}, r"'frequency_penalty' must be a finite number >= -2 and <= 2, got 'one'"),
    ({"min_p": -0.1}, r"'min_p' must be a finite number >= 0 and <= 1"),
    ({"min_tokens": 1.5}, r"'min_tokens' must be an integer from 0"),
    ({"logit_bias": [5]}, r"'logit_bias' must be an object of token ids to biases"),
    ({"logit_bias": {"abc": 1}}, r"'logit_bias' keys must be token ids \(an integer from 0 to 2147483647\), got 'abc'"),
    ({"logit_bias": {"-1": 1}}, r"'logit_bias' keys must be token ids"),
    ({"logit_bias": {"5": 101}}, r"'logit_bias\[5\]' must be a finite number >= -100 and <= 100, got 101"),
    ({"logit_bias": {"5": None}}, r"'logit_bias\[5\]' must be a finite number >= -100 and <= 100, got null"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "'logit_bias' has 1025 entries; at most 1024"),
    ({"stop_token_ids": 5}, "'stop_token_ids' must be a list of token ids"),
    ({"stop_token_ids": ["7a"]}, r"'stop_token_ids\[\]' must be an integer from 0"),
    ({"stop_token_ids": list(range(257))}, "'stop_token_ids' has 257 entries; at most 256"),
    ({"include_stop_str_in_output": "1.0"}, "'include_stop_str_in_output' must be true or false"),
    ({"allowed_token_ids": []}, r"'allowed_token_ids' is empty, which allows no token; leave it out \(or null\)"),
    ({"allowed_token_ids": 5}, "'allowed_token_ids' must be a list of token ids"),
    ({"allowed_token_ids": [5, -1]}, r"'allowed_token_ids\[\]' must be an integer from 0"),
    ({"allowed_token_ids": list(range(65537))}, "'allowed_token_ids' has 65537 entries; at most 65536"),
    ({"bad_words": "red"}, r"'bad_words' must be a list of strings, such as \["),
    ({"bad_words": ["red", 5]}, r"'bad_words' must be a list of strings"),
    ({"bad_words": ["red", ""]}, "'bad_words': bad_words cannot contain an empty string"),
    ({"bad_words": [" \t"]}, "or one of spaces alone; leave it out"),
    ({"bad_words": ["w"] * 129}, "'bad_words' has 129 entries; at most 128"),
    ({"bad_words": ["w" * 513]}, "'bad_words': a bad word has 513 characters; at most 512"),
])  # fmt: skip
def test_vllm_sampling_options_out_of_range_are_400s_naming_field_and_range(fields, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(body(**fields))


def test_vllm_and_openai_spellings_are_understood():
    """top_k -1 is vLLM's "off"; `developer` is OpenAI's newer system role; an assistant message of
    its own history may have null content. They were 400s."""
    b = body(top_k=-1)
    b["messages"] = [
        {"role": "developer", "content": "be brief"},
        *b["messages"],
        {"role": "assistant", "content": None},
        {"role": "user", "content": "and then?"},
    ]
    req = parse(b)
    assert req.generation.top_k == 0
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "user"]
    assert req.messages[2] == Message.assistant("")
    with pytest.raises(InvalidRequest, match="must be an integer from -1"):
        parse(body(top_k=-2))
    with pytest.raises(InvalidRequest, match='stream_options only goes with "stream": true'):
        parse(body(stream_options={"include_usage": True}))


def test_no_seed_is_left_for_the_pipeline_to_draw():
    assert parse(body(temperature=1.0)).generation.seed is None
    assert parse(body(temperature=1.0, seed=0)).generation.seed == 0


# What pydantic 2's lax mode (vLLM's request models) makes of a JSON value for an `int` field.
VLLM_INTS = ((2, 2), (2.0, 2), (-0.0, 0), (True, 1), (False, 0), ("2", 2), (" 2 ", 2), ("\t+2\n", 2),
             ("2.00", 2), ("-0", 0), ("007", 7), ("1_000", 1000))  # fmt: skip
NOT_VLLM_INTS = (2.5, float("inf"), float("nan"), "2.5", "2.", ".0", "1e3", "0x10", "1__0", "_1", "2 0", "",
                 "\u0662", [2], {"n": 2})  # fmt: skip


@pytest.mark.parametrize(("value", "number"), VLLM_INTS)
def test_integer_fields_take_what_vllms_int_takes(value, number):
    """Every integer field reads its value as vLLM's pydantic `int` does (lax: 2.0, "2", true):
    chat's, a Responses body's through it, completions' and the token id lists alike."""
    positive = value if number >= 1 else None  # max_tokens, num_frames: from 1
    req = parse(
        body(
            top_k=value, seed=value, min_tokens=value, priority=value, stop_token_ids=[value],
            allowed_token_ids=[value], logprobs=True, top_logprobs=value, max_tokens=positive,
            n=value if 1 <= number <= 16 else None, media={"num_frames": positive},
        )
    )  # fmt: skip
    g = req.generation
    assert (g.top_k, g.seed, g.min_tokens, g.priority, g.logprobs) == (number,) * 5
    assert (g.stop_token_ids, g.allowed_token_ids) == ((number,), (number,))
    if number >= 1:
        assert (g.max_new_tokens, req.sampling.num_frames) == (number, number)
    assert g.n == (number if 1 <= number <= 16 else 1)


@pytest.mark.parametrize("value", NOT_VLLM_INTS)
def test_integer_fields_refuse_what_vllms_int_refuses(value):
    for field in ("max_tokens", "top_k", "seed", "n", "priority"):
        with pytest.raises(InvalidRequest, match=f"'{field}' must be an integer"):
            parse(body(**{field: value}))
    with pytest.raises(InvalidRequest, match=r"'stop_token_ids\[\]' must be an integer"):
        parse(body(stop_token_ids=[value]))


# What pydantic 2's lax mode makes of a JSON value for a `float` field (vLLM's temperature, ...):
# they were 400s here (a float field took a JSON number alone).
VLLM_FLOATS = (("0.5", 0.5), (" 0.5 ", 0.5), ("5e-1", 0.5), (".5", 0.5), ("1", 1.0), (1, 1.0), (True, 1.0),
               (False, 0.0), ("0", 0.0))  # fmt: skip
NOT_VLLM_FLOATS = (
    "half",
    "0x1",
    "1__0",
    "",
    "nan",
    "inf",
    "-Infinity",
    [0.5],
    {"t": 1},
)  # the last 5: ranges


@pytest.mark.parametrize(("value", "number"), VLLM_FLOATS)
def test_float_fields_take_what_vllms_float_takes(value, number):
    """Every float field reads its value as vLLM's pydantic `float` does (lax: "0.5", 1, true):
    the sampling options, logit_bias's values and the media options alike."""
    req = parse(
        body(
            temperature=value, top_p=value if number > 0 else None, repetition_penalty=value if number > 0 else None,
            presence_penalty=value, frequency_penalty=value, min_p=value, logit_bias={"5": value},
            media={"fps": value if number > 0 else None, "start_time_s": value},
        )
    )  # fmt: skip
    g = req.generation
    assert (g.temperature, g.presence_penalty, g.frequency_penalty, g.min_p) == (number,) * 4
    assert g.logit_bias == ((5, number),) and req.sampling.start_time_s == number
    if number > 0:
        assert (g.top_p, g.repetition_penalty, req.sampling.fps) == (number,) * 3
    assert all(
        type(v) is float for v in (g.temperature, g.min_p, g.logit_bias[0][1], req.sampling.start_time_s)
    )


@pytest.mark.parametrize("value", NOT_VLLM_FLOATS)
def test_float_fields_refuse_what_vllms_float_or_their_range_refuses(value):
    for field in ("temperature", "top_p", "presence_penalty", "min_p", "repetition_penalty"):
        with pytest.raises(InvalidRequest, match=f"^'{field}' must be a finite number"):
            parse(body(**{field: value}))
    with pytest.raises(InvalidRequest, match=r"^'logit_bias\[5\]' must be a finite number"):
        parse(body(logit_bias={"5": value}))
    with pytest.raises(InvalidRequest, match="^'fps' must be a finite number"):
        parse(body(media={"fps": value}))


BOOLEAN_FIELDS = ("stream", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                  "spaces_between_special_tokens", "include_reasoning", "return_token_ids", "logprobs",
                  "parallel_tool_calls", "add_generation_prompt")  # fmt: skip


@pytest.mark.parametrize(("value", "flag"), [("yes", True), ("on", True), ("t", True), ("TRUE", True), (1, True),
                                             ("1", True), (1.0, True), ("no", False), ("off", False),
                                             ("false", False), (0, False), ("0", False)])  # fmt: skip
def test_boolean_fields_take_what_vllms_bool_takes(value, flag):
    """Every bool field reads its value as vLLM's pydantic `bool` does ("yes", "off", 1, 0):
    they were 400s here (true and false alone)."""
    fields = dict.fromkeys(BOOLEAN_FIELDS, value)
    extra = {"stream_options": {"include_usage": value, "continuous_usage_stats": value}} if flag else {}
    req = parse(
        body(
            **fields,
            **extra,
            echo=value,
            tools=[],
            structured_outputs={"regex": "a+", "disable_any_whitespace": value},
        )
    )
    g = req.generation
    assert (req.stream, g.ignore_eos, g.include_stop_str_in_output, g.skip_special_tokens) == (flag,) * 4
    assert (g.spaces_between_special_tokens, req.include_reasoning, req.return_token_ids) == (flag,) * 3
    assert (g.logprobs is not None, req.tool_choice.parallel, req.template.add_generation_prompt) == (
        flag,
    ) * 3
    assert (req.echo, g.structured_outputs.disable_any_whitespace) == (flag, flag)
    assert (req.include_usage, req.continuous_usage) == (flag, flag)


@pytest.mark.parametrize("value", [2, -1, 0.5, "maybe", "1.0", " yes", "", [True], {"on": 1}])
def test_boolean_fields_refuse_what_vllms_bool_refuses(value):
    for field in BOOLEAN_FIELDS:
        with pytest.raises(InvalidRequest, match=f"^'{field}' must be true or false, got "):
            parse(body(**{field: value}))
    with pytest.raises(InvalidRequest, match="^'stream_options.include_usage' must be true or false"):
        parse(body(stream=True, stream_options={"include_usage": value}))


def test_unsupported_fields_ask_for_nothing_as_vllm_reads_their_neutral_values():
    """A field epd does not implement is read as vLLM reads its type before it is found to ask for
    nothing: best_of "1", use_beam_search "no", length_penalty "1.0" ask for nothing."""
    neutral = dict(best_of="1", use_beam_search="no", length_penalty="1.0", watermarking=0,
                   return_prompt_text="off", add_special_tokens="f", max_repetition_pattern_size="0",
                   min_repetition_pattern_size=False, repetition_min_count=0.0)  # fmt: skip
    assert parse(body(**neutral)).generation == GenerationConfig(max_new_tokens=32, fit_max_new_tokens=True)
    for field, value in (("best_of", "2"), ("use_beam_search", "on"), ("length_penalty", "0.5"),
                         ("watermarking", 1), ("best_of", "1e0"), ("best_of", "one")):  # fmt: skip
        with pytest.raises(
            InvalidRequest, match=f"^'{field}' is not supported by this server; leave it unset"
        ):
            parse(body(**{field: value}))


def test_priority_is_read_as_vllms_integer_and_refused_outside_the_wires_range():
    """vLLM's `priority` (chat and completions share `answer_options`): an integer, negative too;
    whether the server takes a non-zero one is the pipeline's check (prefill's --scheduling-policy)."""
    assert parse(body(priority=-(2**31))).generation.priority == -(2**31)
    assert parse(body(priority=7)).generation.priority == 7
    assert parse(body()).generation.priority == 0
    for bad, match in ((2**31, "'priority' must be an integer from"), (1.5, "'priority' must be an integer"),
                       ([1], "'priority'"), ("1.5", "'priority'")):  # fmt: skip
        with pytest.raises(InvalidRequest, match=match):
            parse(body(priority=bad))
