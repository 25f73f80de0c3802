"""The Responses API tests' shared parts: a body parsed as the handler parses it, an answer's
summary and the whole response made of it."""

from __future__ import annotations

from epd.gateway.ask_types import AskSummary
from epd.gateway.responses_events import response_body
from epd.gateway.responses_protocol import parse_responses_request
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import TokenStep
from epd.video.types import SamplingOptions

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
VIDEO = "data:video/mp4;base64,AAAA"


def parse(**body):
    return parse_responses_request({"model": "m", **body}, "m", SamplingOptions(), GenerationConfig())


def summary(answer: str, finish_reason: str = "stop") -> AskSummary:
    return AskSummary("r1", answer, [5, 6, 7], finish_reason, 0, 0, 4, {}, 0, False, "", [])


def whole(answer: AskSummary, request, thinking, created=None) -> dict:
    """The whole response of an answer that came in one step."""
    return response_body(answer, request, thinking, [TokenStep(answer.token_ids, answer.answer)], created)
