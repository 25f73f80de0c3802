"""Chat-completions bodies -> the pipeline's request, and the error mapping to HTTP statuses."""

from __future__ import annotations

import grpc
import pytest

from gateway.openai_protocol import http_status_of, parse_chat_request
from model_runtime.sampling import GenerationConfig
from transport.errors import InvalidRequest, NotFound
from video.types import SamplingOptions

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
    assert (req.question, req.media_url, req.modality, req.stream) == (
        "what happens?",
        "data:x",
        "video",
        False,
    )
    assert req.generation == GenerationConfig(max_new_tokens=32)
    assert req.sampling == SamplingOptions()

    req = parse(
        body(
            max_tokens=5, temperature=0.7, top_p=0.9, top_k=4, seed=3, stop="END", stream=True,
            stream_options={"include_usage": True}, media={"fps": 1, "num_frames": 8, "max_frames": 16},
        )
    )  # fmt: skip
    assert req.generation == GenerationConfig(
        max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=4, seed=3, stop=("END",)
    )
    assert (req.sampling.fps, req.sampling.num_frames, req.sampling.max_frames) == (1.0, 8, 16)
    assert req.stream and req.include_usage
    assert parse(body(max_completion_tokens=7, max_tokens=5)).generation.max_new_tokens == 7


def test_image_part_and_string_url():
    b = body()
    b["messages"][0]["content"][1] = {"type": "image_url", "image_url": "data:y"}
    req = parse(b)
    assert (req.media_url, req.modality) == ("data:y", "image")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"messages": []}, "non-empty list"),
        (
            {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]},
            "exactly one user",
        ),
        ({"messages": [{"role": "user", "content": "no media here"}]}, "exactly one video_url or image_url"),
        ({"media": {"frames": 3}}, "unknown media options"),
        ({"media": {"num_frames": True}}, "'num_frames' must be an integer"),
        ({"max_tokens": "9"}, "'max_tokens' must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"top_p": 0}, "0 < top_p <= 1"),
        ({"stop": [1]}, "list of strings"),
        ({"n": 2}, "only n=1"),
    ],
)
def test_invalid_bodies(change, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(body(**change))


def test_two_media_parts_and_unknown_parts():
    b = body()
    b["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "data:z"}})
    with pytest.raises(InvalidRequest, match="got 2"):
        parse(b)
    b = body()
    b["messages"][0]["content"].append({"type": "input_audio", "input_audio": {}})
    with pytest.raises(InvalidRequest, match="unsupported content part 'input_audio'"):
        parse(b)


def test_unknown_model_is_not_found():
    with pytest.raises(NotFound, match="GET /v1/models lists 'epd'"):
        parse(body(model="gpt-4o"))


def test_http_status_of():
    assert http_status_of(grpc.StatusCode.INVALID_ARGUMENT)[0] == 400
    assert http_status_of(grpc.StatusCode.PERMISSION_DENIED)[0] == 403
    assert http_status_of(grpc.StatusCode.NOT_FOUND)[0] == 404
    assert http_status_of(grpc.StatusCode.RESOURCE_EXHAUSTED)[0] == 413
    assert http_status_of(grpc.StatusCode.UNAVAILABLE)[0] == 503
    assert http_status_of(grpc.StatusCode.INTERNAL)[0] == 500
