"""An error's HTTP status and OpenAI error body (`epd.gateway.http_errors`): the gRPC status a
domain error maps to, as vLLM's OpenAI server answers it; a refusal for load (429, retry) apart
from a limit (413, send less), whether the gateway or a stage refused; through the front door, a
model that cannot load is a 500 whose path stays in the server log."""

from __future__ import annotations

import grpc
import pytest

from epd.gateway.http_body import BodyTimedOut
from epd.gateway.http_errors import error_body, http_error_of, http_status_of
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.sampling import ConstraintBusy
from epd.stages.errors import Busy, DeadlineExceeded, ResourceExhausted
from epd.transport.errors import UpstreamError
from tests.unit.gateway.scripted_http import STREAM_BODY, _post_chat


def test_http_status_of():
    assert http_status_of(grpc.StatusCode.INVALID_ARGUMENT)[0] == 400
    assert http_status_of(grpc.StatusCode.PERMISSION_DENIED)[0] == 403
    assert http_status_of(grpc.StatusCode.NOT_FOUND)[0] == 404
    assert http_status_of(grpc.StatusCode.RESOURCE_EXHAUSTED)[0] == 413
    assert http_status_of(grpc.StatusCode.UNAVAILABLE)[0] == 503
    assert http_status_of(grpc.StatusCode.INTERNAL)[0] == 500
    # A stage failed mid-answer; a model that cannot be loaded is the server's to fix, not the request's.
    assert http_status_of(grpc.StatusCode.ABORTED) == (502, "server_error")
    assert http_status_of(grpc.StatusCode.FAILED_PRECONDITION) == (500, "server_error")


@pytest.mark.parametrize(
    ("exc", "status", "error_type"),
    [
        (Busy("the queue is full; raise --max-queued-requests"), 429, "rate_limit_error"),
        (ResourceExhausted("the video is too long; send a shorter one"), 413, "request_too_large"),
        # A stage's refusal passed on by the gateway: retry only when the stage marked it so.
        (
            UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode is full", retry_after_s=1),
            429,
            "rate_limit_error",
        ),
        (
            UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the prompt is too long"),
            413,
            "request_too_large",
        ),
        (ConstraintBusy("compiles still run; retry later"), 429, "rate_limit_error"),
    ],
)
def test_a_refusal_for_load_is_a_429_to_retry_and_a_limit_a_413(exc, status, error_type):
    assert http_error_of(exc) == (status, error_type, str(exc))


def test_an_http_layer_error_keeps_the_status_grpc_has_no_code_for():
    """A body that came too slowly is the client's delay (408), not an upstream's (504)."""
    assert http_error_of(BodyTimedOut("the body did not arrive in time"))[:2] == (408, "timeout")
    assert http_error_of(DeadlineExceeded("prefill did not answer in time"))[:2] == (504, "timeout")


def test_error_body_is_vllms_with_the_http_status_as_an_integer_code():
    assert error_body("send less", "request_too_large", 413) == {
        "error": {"message": "send less", "type": "request_too_large", "param": None, "code": 413}
    }


class _ModelLoadFailsPipeline(Pipeline):
    """An embedded front door whose model cannot be loaded (`ModelLoadError`)."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.model_runtime.loader import ModelLoadError

        raise ModelLoadError("/models/m", "model.safetensors is truncated or corrupt")
        yield


def test_a_model_that_cannot_load_is_a_500_not_the_clients_400_and_its_path_stays_in_the_log(caplog):
    """FAILED_PRECONDITION (gRPC's code for it) was mapped to 400 invalid_request_error, telling the
    client to change a request that nothing in it could fix; vLLM answers 500 for an engine that
    failed. Streamed or not, before any token. The error's own message, which names the model's
    local path, reached the client with it: it goes to the server log now."""
    import json

    body = {**STREAM_BODY, "stream": False}
    for sent in (body, STREAM_BODY):
        caplog.clear()
        error = json.loads(_post_chat(_ModelLoadFailsPipeline(), sent))["error"]
        assert (error["code"], error["type"]) == (500, "server_error"), error
        assert error["message"].startswith("the server cannot load its model; its operator must fix it")
        assert "/models/m" not in error["message"] and "safetensors" not in error["message"]
        assert "cannot load /models/m: model.safetensors is truncated or corrupt" in caplog.text
