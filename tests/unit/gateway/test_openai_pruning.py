"""Pruning options in the OpenAI body and the kept-token grid the web demo draws."""

import pytest

from epd.gateway.ask_types import AskSummary
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.summary_fields import kept_token_grid
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.video.types import SamplingOptions

BODY = {
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what?"},
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            ],
        }
    ]
}


def parse(extra):
    return parse_chat_request({**BODY, **extra}, "epd", SamplingOptions(), GenerationConfig())


def test_pruning_preset_and_knobs():
    cfg = parse(
        {"pruning": {"preset": "light", "knobs": {"kv_keep_ratio": 0.3, "decode_evict": True}}}
    ).pruning
    assert cfg.kv_compress and cfg.kv_keep_ratio == 0.3 and cfg.decode_evict
    assert not parse({}).pruning.any_enabled


@pytest.mark.parametrize(
    "value,match",
    [
        ({"preset": "nope"}, "unknown pruning preset"),
        ({"knobs": {"kv_keep_ratio": 5}}, "kv_keep_ratio must be in"),
        ({"knobs": {"bogus": 1}}, "unknown pruning option"),
        ({"other": 1}, "must be an object like"),
    ],
)
def test_bad_pruning_is_a_400(value, match):
    with pytest.raises(InvalidRequest, match=match):
        parse({"pruning": value})


def test_kept_token_grid_places_each_token():
    summary = AskSummary(
        "r",
        "",
        [],
        "stop",
        4,
        3,
        10,
        {},
        0,
        False,
        "",
        [],
        grid_thw=(2, 4, 6),
        kept_visual_token_index=[0, 5, 6],
    )
    grid = kept_token_grid(summary)  # 2 groups of 2 x 3 merged tokens
    assert grid == [[[1, 0, 0], [0, 0, 1]], [[1, 0, 0], [0, 0, 0]]]
