"""The request id (epd/transport/tracing.py) through a real grpc.aio server and client on
loopback: taken from `x-request-id` or made, set for the handler, sent on by a traced channel,
returned to the client, in abort messages and in log lines; the OpenTelemetry path off and on."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.stages.request_id import current_request_id
from epd.stages.server_config import ServerConfig
from epd.transport import tracing
from epd.transport.server import create_server, traced_channel

SERVICE = "epd.test.Echo"


def _echo_server(seen: list[str], downstream: list[str] | None = None):
    """Echo/Stream/Fail handlers on raw bytes; each records the request id it runs under.
    With `downstream` ([address]), Relay calls Echo there through a traced channel."""

    async def echo(request: bytes, context) -> bytes:
        seen.append(current_request_id())
        logging.getLogger("epd.test").info("echo handled")
        return request

    async def stream(request: bytes, context):
        seen.append(current_request_id())
        for i in range(3):
            yield bytes([i])

    async def fail(request: bytes, context) -> bytes:
        seen.append(current_request_id())
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the video is not a video")

    async def relay(request: bytes, context) -> bytes:
        assert downstream is not None
        async with traced_channel(downstream[0]) as channel:
            return await channel.unary_unary(f"/{SERVICE}/Echo")(request, timeout=10)

    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "Relay": grpc.unary_unary_rpc_method_handler(relay),
    }
    return lambda server: server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers),)
    )


def _run(scenario):
    return asyncio.run(scenario())


def test_request_id_validation():
    assert tracing.valid_request_id("trace-test-123")
    assert tracing.valid_request_id("a" * 128)
    assert not tracing.valid_request_id("a" * 129)
    assert not tracing.valid_request_id("")
    assert not tracing.valid_request_id("has space")
    assert not tracing.valid_request_id("line\nbreak")
    assert not tracing.valid_request_id("ünïcode")
    assert not tracing.valid_request_id(None)
    made = tracing.new_request_id()
    assert tracing.valid_request_id(made) and len(made) == 32


def test_with_request_id_appends_once():
    assert tracing.with_request_id("bad video", "abc") == "bad video (request id abc)"
    assert tracing.with_request_id("bad video (request id abc)", "abc") == "bad video (request id abc)"
    assert tracing.with_request_id("bad video", "") == "bad video"
    # A client's short id is in many a message: it still gets the id (it got none: "a" is in "bad").
    assert tracing.with_request_id("bad video", "a") == "bad video (request id a)"
    assert tracing.with_request_id("video 1 of 2", "1") == "video 1 of 2 (request id 1)"


def test_adopt_prefers_metadata_then_message():
    async def scenario():
        async def from_metadata():
            tracing.begin_request("from-client")
            return tracing.adopt_request_id("from-message")

        async def generated():
            made = tracing.begin_request("")
            return made, tracing.adopt_request_id("from-message"), tracing.adopt_request_id("")

        return await asyncio.create_task(from_metadata()), await asyncio.create_task(generated())

    kept, (made, adopted, again) = _run(scenario)
    assert kept == "from-client"
    assert made != "from-message" and adopted == "from-message" and again == "from-message"


def test_server_takes_the_id_from_metadata_returns_it_and_relays_it():
    async def scenario():
        seen_back: list[str] = []
        back = await create_server(ServerConfig(), _echo_server(seen_back), [SERVICE])
        seen_front: list[str] = []
        front = await create_server(
            ServerConfig(), _echo_server(seen_front, [f"127.0.0.1:{back.port}"]), [SERVICE]
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
                call = channel.unary_unary(f"/{SERVICE}/Relay")(
                    b"hi", metadata=((tracing.REQUEST_ID_KEY, "trace-test-123"),), timeout=10
                )
                answer = await call
                initial = await call.initial_metadata()
                # no id from the client: one is made, and returned
                call2 = channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=10)
                chunks = [c async for c in call2]
                initial2 = await call2.initial_metadata()
                # a bad id (a space) is replaced
                call3 = channel.unary_unary(f"/{SERVICE}/Echo")(
                    b"", metadata=((tracing.REQUEST_ID_KEY, "not valid"),), timeout=10
                )
                await call3
                initial3 = await call3.initial_metadata()
        finally:
            await front.stop(0)
            await back.stop(0)
        return answer, initial, chunks, initial2, initial3, seen_front, seen_back

    answer, initial, chunks, initial2, initial3, seen_front, seen_back = _run(scenario)
    assert answer == b"hi"
    assert tracing.metadata_value(initial) == "trace-test-123"
    assert seen_back == ["trace-test-123"]  # the traced channel carried it one hop further
    assert chunks == [b"\x00", b"\x01", b"\x02"]
    made = tracing.metadata_value(initial2)
    assert tracing.valid_request_id(made) and seen_front[0] == made
    replaced = tracing.metadata_value(initial3)
    assert replaced != "not valid" and tracing.valid_request_id(replaced)


def test_abort_message_and_trailers_carry_the_id():
    async def scenario():
        seen: list[str] = []
        hs = await create_server(ServerConfig(), _echo_server(seen), [SERVICE])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary(f"/{SERVICE}/Fail")(
                        b"", metadata=((tracing.REQUEST_ID_KEY, "abc123"),), timeout=10
                    )
        finally:
            await hs.stop(0)
        return err.value

    err = _run(scenario)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "the video is not a video (request id abc123)"
    assert tracing.metadata_value(err.trailing_metadata()) == "abc123"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_log_lines_carry_the_id(log_format, capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = []
    try:
        tracing.configure_logging("INFO", log_format)

        async def scenario():
            hs = await create_server(ServerConfig(), _echo_server([]), [SERVICE])
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                    await channel.unary_unary(f"/{SERVICE}/Echo")(
                        b"", metadata=((tracing.REQUEST_ID_KEY, "log-id-7"),), timeout=10
                    )
            finally:
                await hs.stop(0)

        _run(scenario)
        logging.getLogger("epd.test").info("outside any request")
    finally:
        for h in root.handlers:
            h.flush()
        root.handlers, level = saved
        root.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    if log_format == "json":
        records = [json.loads(line) for line in lines if line.startswith("{")]
        handled = [r for r in records if r["message"] == "echo handled"]
        assert handled and handled[0]["request_id"] == "log-id-7"
        ended = [r for r in records if r["message"].startswith(f"rpc /{SERVICE}/Echo OK total_ms=")]
        assert ended and ended[0]["request_id"] == "log-id-7"
        outside = [r for r in records if r["message"] == "outside any request"]
        assert outside and "request_id" not in outside[0]
    else:
        assert any(line.endswith("echo handled request_id=log-id-7") for line in lines), lines
        assert any(
            f"rpc /{SERVICE}/Echo OK total_ms=" in line and "request_id=log-id-7" in line for line in lines
        )
        assert any(line.endswith("outside any request") for line in lines)


def test_unknown_log_format_is_refused():
    with pytest.raises(ValueError, match="json"):
        tracing.configure_logging("INFO", "xml")


def test_otel_off_by_default(monkeypatch):
    monkeypatch.delenv(tracing.OTEL_ENV, raising=False)
    assert not tracing.setup_otel_from_env()
    assert not tracing.otel_enabled()
    assert tracing.RequestSpan("x").span is None


def test_otel_spans_per_call_when_enabled():
    """Server and client spans of one relayed call, in one trace, with the request id."""
    trace = pytest.importorskip("opentelemetry.trace", reason="the opentelemetry package is not installed")
    started: list[tuple[str, str, int, dict]] = []
    ended: list[str] = []

    class Span(trace.NonRecordingSpan):
        def __init__(self, name, context, parent_trace_id):
            super().__init__(context)
            self.name, self.attributes = name, {}
            self.parent_trace_id = parent_trace_id

        def set_attribute(self, key, value):
            self.attributes[key] = value

        def end(self, end_time=None):
            ended.append(self.name)

    class Tracer(trace.Tracer):
        def start_span(self, name, context=None, kind=trace.SpanKind.INTERNAL, **kwargs):
            parent = trace.get_current_span(context).get_span_context()
            trace_id = parent.trace_id if parent.is_valid else len(started) + 1
            ctx = trace.SpanContext(
                trace_id,
                len(started) + 1,
                is_remote=False,
                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
            )
            span = Span(name, ctx, parent.trace_id if parent.is_valid else 0)
            started.append((name, kind.name, trace_id, span.attributes))
            return span

        def start_as_current_span(self, *args, **kwargs):  # pragma: no cover - unused
            raise NotImplementedError

    class Provider(trace.TracerProvider):
        def get_tracer(self, *args, **kwargs):
            return Tracer()

    assert tracing.enable_otel(Provider())
    try:

        async def scenario():
            back = await create_server(ServerConfig(), _echo_server([]), [SERVICE])
            front = await create_server(
                ServerConfig(), _echo_server([], [f"127.0.0.1:{back.port}"]), [SERVICE]
            )
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
                    await channel.unary_unary(f"/{SERVICE}/Relay")(
                        b"", metadata=((tracing.REQUEST_ID_KEY, "otel-1"),), timeout=10
                    )
                # The gateway's health polls go over the stages' traced channels: no span either side.
                async with traced_channel(f"127.0.0.1:{back.port}") as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=10
                    )
                    # nothing set it serving
                    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
                await asyncio.sleep(0.1)  # the client span ends from the call's done callback
            finally:
                await front.stop(0)
                await back.stop(0)

        _run(scenario)
    finally:
        tracing.disable_otel()
    names = [(name, kind) for name, kind, _, _ in started]
    assert names == [
        (f"/{SERVICE}/Relay", "SERVER"),
        (f"/{SERVICE}/Echo", "CLIENT"),
        (f"/{SERVICE}/Echo", "SERVER"),
    ]
    assert len({trace_id for _, _, trace_id, _ in started}) == 1  # one trace across both hops
    assert all(attrs.get("epd.request_id") == "otel-1" for _, _, _, attrs in started)
    assert sorted(ended) == sorted(name for name, _ in names)


class _ContextWhoseMetadataSendFails:
    """The servicer context of a call as the interceptor sends the request id as initial metadata."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def invocation_metadata(self):
        return ()

    async def send_initial_metadata(self, metadata) -> None:
        raise self.error


def _streamed_by_the_interceptor(error: Exception) -> tuple[list[bytes], str, bool]:
    """What the traced stream handler hands gRPC to write when sending the initial metadata fails
    with `error`: (messages, how the handler ended, whether the servicer's stream was closed)."""
    closed = []

    async def stream(request: bytes, context):
        try:
            yield b"first"
            yield b"second"
        finally:
            closed.append(True)

    async def continuation(details):
        return grpc.unary_stream_rpc_method_handler(stream)

    async def scenario():
        details = SimpleNamespace(method=f"/{SERVICE}/Stream", invocation_metadata=())
        handler = await tracing.ServerTracing().intercept_service(continuation, details)
        sent: list[bytes] = []
        try:
            async for message in handler.unary_stream(b"", _ContextWhoseMetadataSendFails(error)):
                sent.append(message)
        except asyncio.CancelledError:
            return sent, "cancelled", bool(closed)
        return sent, "ended", bool(closed)

    return _run(scenario)


def test_a_call_that_ended_as_its_metadata_went_out_gets_no_write():
    """A client that cancels (or whose deadline passes) just as the request id goes out as initial
    metadata: gRPC core fails that send and counts the metadata as sent, grpc.aio does not, so its
    write of the first message would send them again and core refuses it
    (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, logged as an error by grpc; once in a 26,000-request
    soak). The interceptor ends such a call as a cancelled one: nothing is handed to gRPC to write,
    and the servicer's stream is closed now."""
    from grpc._cython import cygrpc  # what grpc.aio raises for a send core failed

    failed = cygrpc.ExecuteBatchError('Failed "execute_batch": (SendInitialMetadataOperation,)')
    assert _streamed_by_the_interceptor(failed) == ([], "cancelled", True)


def test_metadata_the_servicer_sent_itself_leaves_the_stream_alone():
    already = grpc.aio.UsageError("Send initial metadata failed: already sent")
    assert _streamed_by_the_interceptor(already) == ([b"first", b"second"], "ended", True)
