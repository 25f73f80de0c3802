"""`rpc_errors` behind a real grpc.aio server on 127.0.0.1 (in this process): each domain error
reaches the client as its status code with its message; anything unexpected is INTERNAL with a
generic message (its text goes to the server log only); unary and server-streaming handlers
behave alike, and a stream's items sent before the error arrive first.

(tests/unit/transport/test_stage_errors.py covers `stage_error`, the client side.)
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from epd.model_runtime.loader import ModelLoadError
from epd.stages.errors import (
    DeadlineExceeded,
    EpdError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from epd.transport.errors import MODEL_NOT_LOADED, UpstreamError, rpc_errors
from epd.video.types import MediaError, MediaLimitError
from tests.unit.plumbing.grpc_fakes import server_stream, start_server, unary

HANG_GUARD_S = 30.0
GENERIC = "internal error; the server log has details"
SECRET = "/var/lib/epd/models/x.safetensors at 10.1.2.3:50052"
Code = grpc.StatusCode


class Servicer:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    @rpc_errors
    async def Unary(self, request: bytes, context) -> bytes:
        await asyncio.sleep(0)
        raise self.error

    @rpc_errors
    async def Stream(self, request: bytes, context):
        yield b"item 1"
        await asyncio.sleep(0)
        yield b"item 2"
        raise self.error

    @rpc_errors
    async def Aborts(self, request: bytes, context) -> bytes:
        await context.abort(Code.FAILED_PRECONDITION, "the handler's own status")

    @rpc_errors
    async def StreamAborts(self, request: bytes, context):
        yield b"item 1"
        await context.abort(Code.FAILED_PRECONDITION, "the handler's own status")

    @rpc_errors
    async def Ok(self, request: bytes, context) -> bytes:
        return b"ok:" + request


def _handlers(servicer: Servicer) -> dict[str, grpc.RpcMethodHandler]:
    return {
        "Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary),
        "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
        "Aborts": grpc.unary_unary_rpc_method_handler(servicer.Aborts),
        "StreamAborts": grpc.unary_stream_rpc_method_handler(servicer.StreamAborts),
        "Ok": grpc.unary_unary_rpc_method_handler(servicer.Ok),
    }


async def _call_both(error: BaseException):
    """((code, details) of the unary call, (items, code, details) of the streaming call)."""
    server, address = await start_server(_handlers(Servicer(error)))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unary_error:
                await unary(channel, "Unary")(b"", timeout=HANG_GUARD_S)
            items: list[bytes] = []
            with pytest.raises(grpc.aio.AioRpcError) as stream_error:
                async for item in server_stream(channel, "Stream")(b"", timeout=HANG_GUARD_S):
                    items.append(item)
            # The server serves on after failed calls.
            ok = await unary(channel, "Ok")(b"x", timeout=HANG_GUARD_S)
    finally:
        await server.stop(0)
    assert ok == b"ok:x"
    u, s = unary_error.value, stream_error.value
    return (u.code(), u.details()), (items, s.code(), s.details())


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


DOMAIN_CASES = [
    (InvalidRequest("num_frames must be between 1 and 64; got 500"), Code.INVALID_ARGUMENT),
    (ResourceExhausted("the KV store is full; raise --kv-store-bytes"), Code.RESOURCE_EXHAUSTED),
    (NotFound("unknown or expired kv handle"), Code.NOT_FOUND),
    (Unavailable("the model is still loading"), Code.UNAVAILABLE),
    (DeadlineExceeded("decoding did not finish in 30 s"), Code.DEADLINE_EXCEEDED),
    (PermissionDenied("kv address not allowed by --allow-kv-from"), Code.PERMISSION_DENIED),
    (MediaLimitError("the video is 3600 s long; the limit is 600 s"), Code.RESOURCE_EXHAUSTED),
    (MediaError("the file is not a video this server can decode"), Code.INVALID_ARGUMENT),
    (EpdError("the encoder ended without a result"), Code.INTERNAL),
    (UpstreamError(Code.NOT_FOUND, "prefill: unknown or expired kv handle"), Code.NOT_FOUND),
]


@pytest.mark.parametrize(
    ("error", "code"), DOMAIN_CASES, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.name
)
def test_a_domain_error_reaches_the_client_as_its_status_and_message(error, code):
    (unary_code, unary_details), (items, stream_code, stream_details) = _run(_call_both(error))
    assert (unary_code, unary_details) == (code, str(error))
    assert (stream_code, stream_details) == (code, str(error))
    assert items == [b"item 1", b"item 2"], "items sent before the error arrive"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(f"CUDA out of memory loading {SECRET}"),
        ValueError(f"bad tensor from {SECRET}"),  # a ValueError is not an InvalidRequest
        KeyError(SECRET),
        OSError(2, "No such file", SECRET),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_unexpected_error_is_internal_with_a_generic_message(error, caplog):
    caplog.set_level(logging.ERROR, logger="epd.transport.errors")
    (unary_code, unary_details), (items, stream_code, stream_details) = _run(_call_both(error))
    assert (unary_code, unary_details) == (Code.INTERNAL, GENERIC)
    assert (stream_code, stream_details) == (Code.INTERNAL, GENERIC)
    assert items == [b"item 1", b"item 2"]
    # The operator gets the traceback; the client got nothing of it.
    assert SECRET in caplog.text and "Traceback" in caplog.text


def test_a_model_that_cannot_load_is_failed_precondition_and_its_path_stays_in_the_log(caplog):
    """Its message names the model's local path (and the file at fault): it reached the client,
    and so a gateway's HTTP client (`epd serve --colocate`: the same mapping). The log keeps it."""
    caplog.set_level(logging.ERROR, logger="epd.transport.errors")
    error = ModelLoadError("/var/lib/epd/models/x", "model.safetensors is truncated or corrupt")
    (unary_code, unary_details), (_, stream_code, stream_details) = _run(_call_both(error))
    assert unary_code == stream_code == Code.FAILED_PRECONDITION
    assert unary_details == stream_details == MODEL_NOT_LOADED
    assert "/var/lib/epd" not in unary_details
    assert "cannot load /var/lib/epd/models/x: model.safetensors is truncated or corrupt" in caplog.text


def test_a_raw_upstream_rpc_error_is_passed_on_without_its_details():
    leaky = grpc.aio.AioRpcError(
        Code.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), f"failed to connect to {SECRET}", "debug"
    )
    (unary_code, unary_details), (_, stream_code, stream_details) = _run(_call_both(leaky))
    assert unary_code == stream_code == Code.UNAVAILABLE
    assert unary_details == stream_details
    assert "10.1.2.3" not in unary_details and "failed to connect" not in unary_details


def test_a_handlers_own_abort_passes_through_unchanged():
    async def scenario():
        server, address = await start_server(_handlers(Servicer(RuntimeError("unused"))))
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as unary_error:
                    await unary(channel, "Aborts")(b"", timeout=HANG_GUARD_S)
                items: list[bytes] = []
                with pytest.raises(grpc.aio.AioRpcError) as stream_error:
                    async for item in server_stream(channel, "StreamAborts")(b"", timeout=HANG_GUARD_S):
                        items.append(item)
        finally:
            await server.stop(0)
        return unary_error.value, stream_error.value, items

    u, s, items = _run(scenario())
    for err in (u, s):
        assert (err.code(), err.details()) == (Code.FAILED_PRECONDITION, "the handler's own status")
    assert items == [b"item 1"]
