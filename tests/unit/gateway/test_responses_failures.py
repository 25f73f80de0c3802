"""A Responses API answer that fails: its error event and `response.failed` (OpenAI's forms), a
stream that fails after its 200 or after a keep-alive, and a failure before the first token (its
own status); the HTTP layer over pipelines that fail, not the stages."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from openai.types.responses import ResponseErrorEvent

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_server import start_http_api
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.responses_events import ResponseEvents
from epd.stages.contracts import TokenStep
from epd.stages.errors import Unavailable
from epd.stages.server_config import ServerConfig
from tests.unit.gateway.responses_bodies import parse

GONE = {"error": {"message": "gone", "type": "server_error", "param": None, "code": 502}}


def test_an_error_event_carries_the_error_name_and_the_next_sequence_number():
    """OpenAI's ResponseErrorEvent has a string (or null) `code`: the HTTP status as a number, chat's
    error body's, failed a typed client's parse of the event."""
    shaper = ResponseEvents(parse(input="hi"), "r1", None)
    shaper.start()
    error, failed = shaper.failed(GONE)
    assert error == {
        "type": "error",
        "sequence_number": 2,
        "code": "server_error",
        "message": "gone",
        "param": None,
    }
    ResponseErrorEvent.model_validate(error)  # the openai SDK's own type of the event
    assert (failed["type"], failed["sequence_number"]) == ("response.failed", 3)
    assert (failed["response"]["status"], failed["response"]["error"]) == (
        "failed",
        {"code": "server_error", "message": "gone"},
    )


def test_a_failure_before_any_token_sends_response_created_first():
    """After a keep-alive (the 200 out) and before the first token: the stream still opens with
    response.created and .in_progress, as OpenAI's always does."""
    kinds = [e["type"] for e in ResponseEvents(parse(input="hi"), "r1", None).failed(GONE)]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]


class FailsAfterOneToken(Pipeline):
    """A pipeline whose stage fails after the first token (what a decode replica lost mid-answer
    makes): the HTTP layer's handling of it is under test, not the stages."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]

    async def ask(self, req):  # type: ignore[override]
        yield TokenStep([7], "a")
        raise Unavailable("decode went away")


async def _post_responses(pipeline: Pipeline, body: dict, keepalive_s: float = 15.0) -> tuple[int, str]:
    config = GatewayConfig(
        server=ServerConfig(port=0), http=HttpApiConfig(port=0, sse_keepalive_s=keepalive_s)
    )
    http = await start_http_api(config, pipeline, GatewayMetrics())
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"http://127.0.0.1:{http.port}/v1/responses",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            ) as resp:
                return resp.status, (await resp.read()).decode()
    finally:
        await http.stop()


def test_a_stream_that_fails_after_its_200_ends_with_an_error_event():
    status, text = asyncio.run(_post_responses(FailsAfterOneToken(), {"input": "hi", "stream": True}))
    assert status == 200
    frames = [frame.splitlines() for frame in text.strip().split("\n\n")]
    kinds = [lines[0].removeprefix("event: ") for lines in frames]
    events = [json.loads(lines[1].removeprefix("data: ")) for lines in frames]
    assert kinds == [e["type"] for e in events]  # each event named by its type
    assert kinds[-3:] == ["response.output_text.delta", "error", "response.failed"] and "[DONE]" not in text
    error = events[-2]
    assert (
        error["code"] == "service_unavailable"  # a 503's name: OpenAI's code is a string
        and "decode went away" in error["message"]
        and "request id " in error["message"]
    )
    ResponseErrorEvent.model_validate(error)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


class FailsAtOnce(Pipeline):
    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]

    async def ask(self, req):  # type: ignore[override]
        raise Unavailable("decode went away")
        yield  # an async generator, as the pipeline's


class FailsAfterAKeepAlive(Pipeline):
    """Fails before its first token, but only after the keep-alive sent the 200 (a long encode
    that then failed)."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]

    async def ask(self, req):  # type: ignore[override]
        await asyncio.sleep(0.5)
        raise Unavailable("decode went away")
        yield  # an async generator, as the pipeline's


def test_a_stream_failing_after_a_keep_alive_opens_with_response_created_and_ends_failed():
    body = {"input": "hi", "stream": True}
    status, text = asyncio.run(_post_responses(FailsAfterAKeepAlive(), body, keepalive_s=0.05))
    assert status == 200 and text.startswith(": keep-alive\n\n")
    frames = [f.splitlines() for f in text.strip().split("\n\n") if not f.startswith(": keep-alive")]
    events = [json.loads(lines[1].removeprefix("data: ")) for lines in frames]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "decode went away" in failed["error"]["message"]


def test_a_failure_before_the_first_token_is_its_own_status():
    for stream in (False, True):
        status, text = asyncio.run(_post_responses(FailsAtOnce(), {"input": "hi", "stream": stream}))
        assert status == 503 and json.loads(text)["error"]["code"] == 503
