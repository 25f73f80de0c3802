"""OpenAI's logprobs objects from `TokenLogprob`s (no server): chat's content entries, legacy
completions' parallel lists, and the requests' fields."""

from __future__ import annotations

import math

import pytest

from epd.gateway.logprobs_protocol import (
    chat_logprobs,
    chat_logprobs_option,
    completion_logprobs,
    completion_logprobs_option,
    prompt_logprobs_json,
)
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.stages.errors import InvalidRequest

# A sampled token outside the 2 most likely (a sampled request's may be), then a greedy one whose
# runner-up's logit the model masked (-inf, which JSON cannot hold).
DRAWN = TokenLogprob(7, "é", -3.5, (TopLogprob(1, " a", -0.5), TopLogprob(2, "b", -1.5)))
GREEDY = TokenLogprob(1, " a", -0.25, (TopLogprob(1, " a", -0.25), TopLogprob(9, "<s>", -math.inf)))


def test_chat_entries_carry_token_logprob_bytes_and_k_top_logprobs_the_sampled_token_first():
    """vLLM's order: a position's logprobs are one dict, the sampled token first and then the k
    most likely, and chat's top_logprobs are that dict's first k entries: a sampled token outside
    the k displaces the k-th; a greedy answer's are the k most likely in rank order."""
    assert chat_logprobs([DRAWN, GREEDY]) == {
        "content": [
            {
                "token": "é",
                "logprob": -3.5,
                "bytes": [195, 169],
                "top_logprobs": [
                    {"token": "é", "logprob": -3.5, "bytes": [195, 169]},
                    {"token": " a", "logprob": -0.5, "bytes": [32, 97]},
                ],
            },
            {
                "token": " a",
                "logprob": -0.25,
                "bytes": [32, 97],
                "top_logprobs": [
                    {"token": " a", "logprob": -0.25, "bytes": [32, 97]},
                    {"token": "<s>", "logprob": -9999.0, "bytes": [60, 115, 62]},
                ],
            },
        ]
    }


def test_chat_top_logprobs_put_a_sampled_runner_up_before_the_most_likely():
    runner_up = TokenLogprob(2, "b", -1.5, (TopLogprob(1, " a", -0.5), TopLogprob(2, "b", -1.5)))
    (entry,) = chat_logprobs([runner_up])["content"]
    assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [("b", -1.5), (" a", -0.5)]
    just_sampled = TokenLogprob(2, "b", -1.5)  # top_logprobs 0: none, as vLLM's
    assert chat_logprobs([just_sampled])["content"][0]["top_logprobs"] == []


def test_completion_dicts_hold_the_sampled_token_and_the_most_likely_with_text_offsets():
    body = completion_logprobs([DRAWN, GREEDY], text_offset=4)
    assert body == {
        "tokens": ["é", " a"],
        "token_logprobs": [-3.5, -0.25],
        # k + 1 entries when the sampled token is not among the k, the sampled one first
        "top_logprobs": [{"é": -3.5, " a": -0.5, "b": -1.5}, {" a": -0.25, "<s>": -9999.0}],
        "text_offset": [4, 5],
    }
    assert list(body["top_logprobs"][0]) == ["é", " a", "b"]


@pytest.mark.parametrize(
    ("body", "want"),
    [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5),
     ({"top_logprobs": 0}, None)],
)  # fmt: skip
def test_chat_fields(body, want):
    assert chat_logprobs_option(body) == want


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"top_logprobs": 3}, "'top_logprobs' \\(3\\) needs \"logprobs\": true"),
        ({"logprobs": 5}, "'logprobs' must be true or false"),
        ({"logprobs": True, "top_logprobs": -1}, "'top_logprobs' must be an integer from 0 to"),
    ],
)
def test_bad_chat_fields(body, match):
    with pytest.raises(InvalidRequest, match=match):
        chat_logprobs_option(body)


def test_completion_field():
    assert completion_logprobs_option({}) is None and completion_logprobs_option({"logprobs": 0}) == 0
    with pytest.raises(InvalidRequest, match="'logprobs' must be an integer from 0 to"):
        completion_logprobs_option({"logprobs": -1})


def test_prompt_logprobs_are_vllms_list_of_none_then_token_dicts():
    """vLLM's shape: None for the first prompt token, then {token_id: {logprob, rank,
    decoded_token}}, the prompt token first (its own rank), then the k most likely in rank order,
    k + 1 entries when the prompt token is not among them; -inf floored as the other logprobs."""
    first = TokenLogprob(7, "A", math.nan)
    inside = TokenLogprob(8, "b", -0.5, (TopLogprob(8, "b", -0.5), TopLogprob(9, "c", -1.0)), rank=1)
    outside = TokenLogprob(3, "z", -math.inf, (TopLogprob(8, "b", -0.1), TopLogprob(9, "c", -2.5)), rank=40)
    assert prompt_logprobs_json([first, inside, outside]) == [
        None,
        {
            "8": {"logprob": -0.5, "rank": 1, "decoded_token": "b"},
            "9": {"logprob": -1.0, "rank": 2, "decoded_token": "c"},
        },
        {
            "3": {"logprob": -9999.0, "rank": 40, "decoded_token": "z"},
            "8": {"logprob": -0.1, "rank": 1, "decoded_token": "b"},
            "9": {"logprob": -2.5, "rank": 2, "decoded_token": "c"},
        },
    ]
    assert prompt_logprobs_json(None) is None
    echoed = completion_logprobs([first, inside])
    assert echoed["token_logprobs"] == [None, -0.5] and echoed["top_logprobs"][0] is None
    assert echoed["text_offset"] == [0, 1]
