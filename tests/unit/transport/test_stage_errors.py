"""A stage's failed call becomes a client-safe error: transport-level statuses get a fixed
message naming the stage and the request id; our stages' own messages pass on unchanged."""

from __future__ import annotations

import grpc
import pytest

from epd.gateway.http_errors import http_error_of
from epd.transport.errors import UpstreamError, stage_error, status_of

LEAKY = "ipv4:127.0.0.1:41109: Failed to connect to remote host: Connection refused"
DEBUG = 'UNKNOWN:Error received from peer ipv4:127.0.0.1:41109 {grpc_status:14, created_time:"..."}'


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, DEBUG)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (grpc.StatusCode.UNAVAILABLE, "decode stage unavailable (request id r1)"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "decode stage did not answer in time (request id r1)"),
        (grpc.StatusCode.INTERNAL, "decode stage failed (request id r1)"),
        (grpc.StatusCode.UNKNOWN, "decode stage failed (request id r1)"),
    ],
)
def test_transport_statuses_get_a_fixed_message(code, message, caplog):
    err = stage_error(rpc_error(code, LEAKY), "decode", "r1")
    assert isinstance(err, UpstreamError)
    assert status_of(err) == (code, message)
    # The detail is kept for operators, under the request id.
    assert "r1" in caplog.text and "41109" in caplog.text


def test_unreachable_stage_is_http_503_without_internals():
    status, _, message = http_error_of(
        stage_error(rpc_error(grpc.StatusCode.UNAVAILABLE, LEAKY), "prefill", "abc")
    )
    assert status == 503
    assert message == "prefill stage unavailable (request id abc)"
    assert "ipv4" not in message and "127.0.0.1" not in message and "grpc" not in message.lower()


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND],
)
def test_our_stages_messages_pass_through(code):
    text = "num_frames must be between 1 and 64; got 500"
    assert status_of(stage_error(rpc_error(code, text), "encode", "r2")) == (code, text)


def test_a_raw_rpc_error_is_sanitised_too():
    code, message = status_of(rpc_error(grpc.StatusCode.UNAVAILABLE, LEAKY))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1" not in message and "ipv4" not in message


def test_grpcs_own_message_size_refusal_says_what_to_send_instead(caplog):
    """gRPC raises RESOURCE_EXHAUSTED itself for a message over a channel's 4 MiB; its text names
    byte counts of its own, not what the client sent too much of."""
    raw = rpc_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "CLIENT: Sent message larger than max (5339167 vs. 4194304)"
    )
    status, _, message = http_error_of(stage_error(raw, "prefill", "r3"))
    assert status == 413
    assert message == (
        "the request is larger than the prefill stage takes in one message (4 MiB of conversation "
        "text and settings); send a shorter conversation (request id r3)"
    )
    assert "5339167" in caplog.text  # the detail stays in the log
