"""`UnaryRequestParsing` (epd/transport/server.py) through a real grpc.aio server built by
`create_server`, with synchronous handlers (a servicer's plain `def` method, as gRPC's generated
base classes have): a request that is not protobuf is INVALID_ARGUMENT, a valid one is answered
(one message or a stream), and the handler's own abort is the client's status, as with an async
handler."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from epd.stages.server_config import ServerConfig
from epd.transport import tracing
from epd.transport.server import create_server

SERVICE = "epd.test.SyncParsing"
NOT_PROTOBUF = b"\x0a\xff"  # field 1, a length of 255 with no bytes after it


def _check(request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
    """Not a coroutine: gRPC would run it on a worker thread, off the event loop."""
    assert threading.current_thread() is not threading.main_thread()
    if request.service == "refused":
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused by the handler")
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _watch(request: health_pb2.HealthCheckRequest, context):
    """A plain generator: a stream of answers from a synchronous handler."""
    if request.service == "refused":
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused by the handler")
    for status in (health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING):
        yield health_pb2.HealthCheckResponse(status=status)


def _register(server: grpc.aio.Server) -> None:
    kinds = {"Check": grpc.unary_unary_rpc_method_handler, "Watch": grpc.unary_stream_rpc_method_handler}
    handlers = {
        name: kinds[name](
            behavior,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        for name, behavior in (("Check", _check), ("Watch", _watch))
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _calls(method: str) -> list[object]:
    """The method's answers to a valid request, a refused one and bytes that are not protobuf:
    each the parsed answer(s) or the call's error."""
    hs = await create_server(ServerConfig(host="127.0.0.1", port=0), _register, [SERVICE])
    results: list[object] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
            call = (channel.unary_unary if method == "Check" else channel.unary_stream)(
                f"/{SERVICE}/{method}"
            )
            for request in (
                health_pb2.HealthCheckRequest(service="ok").SerializeToString(),
                health_pb2.HealthCheckRequest(service="refused").SerializeToString(),
                NOT_PROTOBUF,
            ):
                metadata = ((tracing.REQUEST_ID_KEY, "sync-1"),)
                try:
                    if method == "Check":
                        answer = await call(request, metadata=metadata, timeout=10)
                        results.append([health_pb2.HealthCheckResponse.FromString(answer).status])
                    else:
                        answers = [a async for a in call(request, metadata=metadata, timeout=10)]
                        results.append([health_pb2.HealthCheckResponse.FromString(a).status for a in answers])
                except grpc.aio.AioRpcError as error:
                    results.append(error)
    finally:
        await hs.stop(0)
    return results


@pytest.mark.parametrize(("method", "answer"), [("Check", [1]), ("Watch", [2, 1])])
def test_a_synchronous_handlers_request_is_parsed_and_its_aborts_kept(method, answer):
    served, refused, junk = asyncio.run(_calls(method))
    assert served == answer
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.details() == "refused by the handler (request id sync-1)"
    assert isinstance(junk, grpc.aio.AioRpcError)
    assert junk.code() == grpc.StatusCode.INVALID_ARGUMENT, junk.details()


def test_the_health_services_synchronous_list_stays_unimplemented():
    """grpc.health.v1.Health's List, which the aio HealthServicer leaves as its generated base's
    plain `def` (UNIMPLEMENTED), on every server `create_server` builds; not protobuf: INVALID_ARGUMENT."""

    async def calls() -> list[grpc.aio.AioRpcError]:
        hs = await create_server(ServerConfig(host="127.0.0.1", port=0), lambda server: None, [])
        errors = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                for request in (health_pb2.HealthListRequest().SerializeToString(), NOT_PROTOBUF):
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await channel.unary_unary("/grpc.health.v1.Health/List")(request, timeout=10)
                    errors.append(error.value)
        finally:
            await hs.stop(0)
        return errors

    unimplemented, junk = asyncio.run(calls())
    assert unimplemented.code() == grpc.StatusCode.UNIMPLEMENTED
    assert junk.code() == grpc.StatusCode.INVALID_ARGUMENT
