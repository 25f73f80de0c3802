"""Proto -> domain checks of what a client sends over gRPC (NaN and infinite floats, malformed
media hashes, unparsable pruning knobs), bearer-token comparison of any string, the upload's
byte-reservation hook, and the message limit's floor. Each used to end as INTERNAL or a 500."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import pytest

from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.server_config import CHUNK_BYTES, MAX_MESSAGE_BYTES, MIN_MESSAGE_BYTES, ServerConfig
from epd.transport.auth import bearer_token, key_matches
from epd.transport.convert import (
    generation_from_proto,
    generation_to_proto,
    media_sha256_from_proto,
    pruning_from_proto,
    sampling_from_proto,
)
from epd.transport.upload import media_input, read_upload
from epd.v1 import common_pb2, gateway_pb2
from epd.video.types import SamplingOptions

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"fps": NAN}, "fps must be a finite number, got nan"),
        ({"fps": INF}, "fps must be a finite number, got inf"),
        ({"start_time_s": NAN}, "start_time_s must be a finite number"),
        ({"end_time_s": -INF}, "end_time_s must be a finite number"),
        ({"fps": 1e308}, "fps must be at most 1000"),
    ],
)
def test_sampling_floats_must_be_finite(fields, match):
    with pytest.raises(ValueError, match=match):  # InvalidRequest or MediaError: INVALID_ARGUMENT both
        sampling_from_proto(common_pb2.VideoSampling(**fields), SamplingOptions())


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"temperature": NAN}, "temperature must be a finite"),
        ({"top_p": INF}, "top_p must be a finite"),
        ({"repetition_penalty": NAN}, "repetition_penalty must be a finite"),
        ({"frequency_penalty": -INF}, "frequency_penalty must be a finite"),
        ({"logit_bias": {7: NAN}}, r"logit_bias\[7\] must be a finite"),
    ],
)
def test_generation_floats_must_be_finite(fields, match):
    with pytest.raises(InvalidRequest, match=match):
        generation_from_proto(common_pb2.GenerationParams(**fields), GenerationConfig())


@pytest.mark.parametrize(
    "message,fields,match",
    [
        (common_pb2.VideoSampling, {"num_frames": -1}, "num_frames must not be negative"),
        (common_pb2.VideoSampling, {"max_pixels": -5}, "max_pixels must not be negative"),
        (common_pb2.VideoSampling, {"end_time_s": -2.0}, "end_time_s must not be negative"),
        (common_pb2.GenerationParams, {"temperature": -1.0}, "temperature must not be negative"),
        (common_pb2.GenerationParams, {"max_new_tokens": -3}, "max_new_tokens must not be negative"),
        (
            common_pb2.GenerationParams,
            {"top_k": -2},
            r"top_k must be >= 1, or 0 or -1 \(vLLM's\) for off, got -2",
        ),
    ],
)
def test_a_negative_setting_is_refused_by_its_name(message, fields, match):
    """The HTTP API's 400 names the field; the gRPC API said only "generation parameters must not
    be negative", leaving the client to guess which."""
    with pytest.raises(ValueError, match=match):  # InvalidRequest or MediaError: INVALID_ARGUMENT both
        if message is common_pb2.VideoSampling:
            sampling_from_proto(message(**fields), SamplingOptions())
        else:
            generation_from_proto(message(**fields), GenerationConfig())


def test_top_k_minus_one_is_off_as_on_the_http_api():
    """vLLM's -1 for "off": the HTTP API took it, the gRPC API (and so the SDK) refused it."""
    assert generation_from_proto(common_pb2.GenerationParams(top_k=-1), GenerationConfig()).top_k == 0


def test_every_generation_setting_crosses_the_wire():
    """vLLM's options too: a stage gets what the front door was sent (zero is 'off' for each)."""
    config = GenerationConfig(
        max_new_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        seed=3,
        stop=("x",),
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        min_p=0.1,
        min_tokens=2,
        logit_bias=((5, -3.0), (11, 100.0)),
        stop_token_ids=(7, 2),
        include_stop_str_in_output=True,
        allowed_token_ids=(9, 4, 9),
        bad_words=("red", " big cat"),
        fit_max_new_tokens=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        logprobs=0,  # 0 is asked (the sampled token's alone), unlike unset
        prompt_logprobs=0,  # as logprobs: 0 is asked
        n=3,
        priority=-2,
        return_prompt_token_ids=True,
        structured_outputs=StructuredOutputs(
            choice=("a", "b c"), disable_any_whitespace=True, after_reasoning=True
        ),
    )
    defaults = GenerationConfig()
    assert all(getattr(config, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(config))
    assert generation_from_proto(generation_to_proto(config), defaults) == config
    assert generation_from_proto(generation_to_proto(defaults), defaults) == defaults
    for spec in (StructuredOutputs(json_schema='{"type":"object"}'), StructuredOutputs(json_object=True),
                 StructuredOutputs(regex="a+"), StructuredOutputs(grammar='root ::= "a"')):  # fmt: skip
        with_spec = dataclasses.replace(config, structured_outputs=spec)
        assert generation_from_proto(generation_to_proto(with_spec), defaults) == with_spec
    # unset: off (and the decode options on, vLLM's defaults)
    unset = generation_from_proto(common_pb2.GenerationParams(), defaults)
    assert unset.repetition_penalty == 1.0
    assert unset.skip_special_tokens and unset.spaces_between_special_tokens


def test_generation_config_refuses_a_nan_temperature():
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got nan"):
        GenerationConfig(temperature=NAN).validate(100)
    GenerationConfig(temperature=0.5).validate(100)


@pytest.mark.parametrize(
    "text",
    ["xyz", "AB" * 32, "ab" * 31, "ab" * 33, "g" * 64, "../" * 21 + "a", "ab" * 31 + "a\u00e9"],
)
def test_malformed_media_sha256_is_invalid_argument(text):
    with pytest.raises(InvalidRequest, match="64 lower-case hex digits"):
        media_sha256_from_proto(text)
    with pytest.raises(InvalidRequest, match="media_sha256"):
        media_input(gateway_pb2.AskHeader(media_sha256=text), b"")


def test_well_formed_media_sha256_is_kept():
    sha = hashlib.sha256(b"video").hexdigest()
    assert media_sha256_from_proto(sha) == sha and media_sha256_from_proto("") == ""
    assert media_input(gateway_pb2.AskHeader(media_sha256=sha), b"").sha256 == sha


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"kv_keep_ratio": "nan"}, "kv_keep_ratio='nan' is not a valid float"),
        ({"temporal_threshold": "inf"}, "temporal_threshold='inf' is not a valid float"),
        ({"prefill_drop_layer": str(2**70)}, "is not a valid int"),
        ({"prefill_drop_layers": f"1,{2**70}"}, "is not a valid tuple"),
        ({"prefill_drop_layer": "9" * 5000}, "is not a valid int"),
    ],
)
def test_pruning_knobs_must_be_finite_and_in_range(knobs, match):
    with pytest.raises(InvalidRequest, match=match):
        pruning_from_proto(common_pb2.PruningOptions(knobs=knobs))


def test_bearer_tokens_of_any_text_compare_without_raising():
    assert key_matches("s3cret", "s3cret")
    for token in ("cl\u00e9", "\udcff\udcfe", "\u4e2d\u6587"):  # non-ASCII, undecodable header bytes
        assert not key_matches(token, "s3cret")
    assert key_matches("cl\u00e9", "cl\u00e9")
    assert bearer_token([("authorization", "Bearer \udcff")]) == "\udcff"


async def _stream(*messages):
    for msg in messages:
        yield msg


def test_read_upload_reserves_each_chunk_and_stops_when_refused():
    header = gateway_pb2.AskRequest(header=gateway_pb2.AskHeader(media_num_bytes=30))
    chunks = [gateway_pb2.AskRequest(media_chunk=b"x" * 10) for _ in range(3)]
    reserved: list[int] = []
    _, data = asyncio.run(read_upload(_stream(header, *chunks), 100, reserved.append))
    assert (data, reserved) == (b"x" * 30, [10, 10, 10])

    def refuse_after_15(num_bytes: int) -> None:
        if sum(reserved) + num_bytes > 15:
            raise ResourceExhausted("budget spent")
        reserved.append(num_bytes)

    reserved.clear()
    with pytest.raises(ResourceExhausted, match="budget spent"):
        asyncio.run(read_upload(_stream(header, *chunks), 100, refuse_after_15))
    assert reserved == [10]


def test_upload_over_the_limit_names_the_flag():
    header = gateway_pb2.AskRequest(header=gateway_pb2.AskHeader(media_num_bytes=101))
    with pytest.raises(ResourceExhausted, match="at most 100.*--max-upload-bytes"):
        asyncio.run(read_upload(_stream(header), 100))


@pytest.mark.parametrize(
    "announced,match",
    [
        (-5, "media_num_bytes must be the upload's size .or 0: not announced., got -5"),
        (10, "the header announced 10 bytes but more arrived; set media_num_bytes to the file's size, or 0"),
        (40, "the header announced 40 bytes but 30 arrived; the upload was cut short"),
    ],
)
def test_an_upload_that_does_not_match_its_announced_size_says_which_way(announced, match):
    header = gateway_pb2.AskRequest(header=gateway_pb2.AskHeader(media_num_bytes=announced))
    chunks = [gateway_pb2.AskRequest(media_chunk=b"x" * 10) for _ in range(3)]
    with pytest.raises(InvalidRequest, match=match):
        asyncio.run(read_upload(_stream(header, *chunks), 100))


def test_message_limit_holds_a_chunk_and_its_header():
    assert MAX_MESSAGE_BYTES >= MIN_MESSAGE_BYTES > CHUNK_BYTES
    with pytest.raises(ValueError, match="max_message_bytes must be at least"):
        ServerConfig(max_message_bytes=CHUNK_BYTES)


def test_the_gateway_refuses_too_many_stop_strings_before_any_stage_is_called():
    """Over gRPC as over HTTP: a stop list of megabytes would pass the gateway's own limits and be
    refused by gRPC itself on the way to a stage (its text, not ours). No stage exists here: the
    refusal comes before the first call."""
    from epd.gateway.ask_types import AskRequest
    from epd.gateway.pipeline import Pipeline
    from epd.stages.contracts import MediaInput
    from epd.stages.messages import question_messages

    request = AskRequest(
        question_messages("what?"),
        MediaInput(b"video"),
        generation=GenerationConfig(stop=tuple("s" * 100 + str(i) for i in range(50_000))),
    )

    async def first_event():
        return await anext(Pipeline(None, None, None).ask(request))  # type: ignore[arg-type]

    with pytest.raises(InvalidRequest, match="stop has 50000 strings; at most 32 are accepted"):
        asyncio.run(first_event())
