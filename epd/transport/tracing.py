"""One request id per request, in every service's log lines and error messages about it.

The id is the client's `x-request-id` (HTTP header on the OpenAI API, gRPC metadata on the
gateway's gRPC API) when it is usable (`valid_request_id`), else one made at the front door
(uuid4 hex). It travels to every stage call as gRPC metadata `x-request-id`; each process keeps
it in a contextvar for the task that serves the request (and the tasks it starts), so that:

- every log record made in that context carries it (`RequestIdFilter` + `TraceFormatter`:
  the text format ends in ` request_id=...`, or one JSON object per line with `--log-format json`);
- every error message a client gets ends in "(request id ...)" (`ServerTracing`'s context's
  `abort`, `with_request_id` for the HTTP API), and the id comes back in the response
  (`x-request-id` initial or trailing gRPC metadata; the HTTP response header);
- every RPC a service serves logs one INFO line when it ends: method, status, total_ms.

Mechanics, so that servicers and stage clients need no edits: `ServerTracing` is a server
interceptor that every `create_server` installs; `client_interceptors()` go on the channels that
call the stages (`traced_channel` in epd/transport/server.py).

OpenTelemetry is optional: with `EPD_OTEL=1` and the `opentelemetry` package importable, each RPC
served and each stage call made is a span (W3C trace context in the metadata, so the spans of one
request form one trace), with the request id as attribute `epd.request_id`. The spans go to the
tracer provider the process has (the SDK's, when `opentelemetry-sdk` and the OTLP exporter are
installed: configured here from the standard OTEL_* variables); without the package nothing changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import grpc

# The id's context variable lives below the transport, so that engines can set it for shared work;
# callers read and set it there, not through this module (pyproject's mypy section: no re-exports).
from epd.stages.request_id import current_request_id, request_id_from_client, set_request_id

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
"""gRPC metadata key and HTTP header of the request id (both lower-case on the wire)."""

MAX_REQUEST_ID_CHARS = 128

OTEL_ENV = "EPD_OTEL"
"""Set to 1 to export OpenTelemetry spans (when the package is installed)."""

UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.", "/epd.v1.LoadService/")
"""Polled by the gateway every few seconds; not requests: no id, no log line, no span."""


# --- the id ---------------------------------------------------------------------------------------


def valid_request_id(value: object) -> bool:
    """Usable as given: 1..128 printable ASCII characters without spaces (it goes into log lines
    as `request_id=VALUE` and into headers, so nothing that would break either)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_REQUEST_ID_CHARS
        and all("!" <= c <= "~" for c in value)
    )


def new_request_id() -> str:
    return uuid.uuid4().hex


def begin_request(client_value: object) -> str:
    """At a front door or a stage server: the client's id when usable, else a new one; set for
    this task and returned."""
    if valid_request_id(client_value):
        set_request_id(str(client_value), from_client=True)
        return str(client_value)
    request_id = new_request_id()
    set_request_id(request_id)
    return request_id


def adopt_request_id(candidate: str) -> str:
    """The request's id once its message names one too (a stage call's `request_id` field, the
    SDK's `AskHeader.request_id`): an id from metadata wins; else a usable `candidate` replaces
    the generated one. Returns the id in force."""
    if not request_id_from_client() and valid_request_id(candidate) and candidate != current_request_id():
        set_request_id(candidate, from_client=True)
    return current_request_id() or begin_request(candidate)


def with_request_id(message: str, request_id: str | None = None) -> str:
    """`message` ending in "(request id ID)", unless it names a request id already (a stage's
    message passed on names the id that stage was given) or there is none. Not a search for
    the id itself: a client's id may be any short string ("a"), found in any message."""
    request_id = current_request_id() if request_id is None else request_id
    if not request_id or "(request id " in message:  # one id per message
        return message
    return f"{message} (request id {request_id})"


def metadata_value(metadata: Iterable[tuple[str, Any]] | None, key: str = REQUEST_ID_KEY) -> str:
    for k, v in metadata or ():
        if k == key:
            return v.decode("ascii", "replace") if isinstance(v, bytes) else str(v)
    return ""


# --- logs -----------------------------------------------------------------------------------------


class RequestIdFilter(logging.Filter):
    """Gives every record `request_id` (the context's, "" outside a request). On handlers, so
    that records of every logger, ours or a library's, get it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = current_request_id()
        return True


TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class TraceFormatter(logging.Formatter):
    """The text format plus ` request_id=ID` when the record has one; or, `json=True`, one
    JSON object per line: ts, level, logger, message, request_id (when set), exc (when any)."""

    def __init__(self, json_lines: bool = False) -> None:
        super().__init__(TEXT_FORMAT)
        self.json_lines = json_lines

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", "") or ""
        if not self.json_lines:
            text = super().format(record)
            if not request_id:
                return text
            first, nl, rest = text.partition("\n")  # after the message, before a traceback
            return f"{first} request_id={request_id}{nl}{rest}"
        body: dict[str, Any] = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if request_id:
            body["request_id"] = request_id
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body)


LOG_FORMATS = ("text", "json")


def configure_logging(level: str | int, log_format: str = "text") -> None:
    """`logging.basicConfig` with the request id in every line (`epd --log-format`)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}; use one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(TraceFormatter(json_lines=log_format == "json"))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler])


def stage_timings(logger: logging.Logger, what: str, **values: object) -> None:
    """One INFO line of a stage's measurements for the request: `WHAT k=v k=v` (floats 1 decimal;
    the request id is added by the log filter)."""
    parts = [f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()]
    logger.info("%s %s", what, " ".join(parts))


# --- OpenTelemetry (optional) ---------------------------------------------------------------------

_tracer: Any = None


def otel_enabled() -> bool:
    return _tracer is not None


def enable_otel(tracer_provider: Any = None) -> bool:
    """Spans from now on, to `tracer_provider` (default: the process's global one). False, and
    nothing changes, when the `opentelemetry` package is not installed."""
    global _tracer
    try:
        from opentelemetry import trace
    except ImportError:
        log.warning("%s is set but the opentelemetry package is not installed: no spans", OTEL_ENV)
        return False
    _tracer = trace.get_tracer("epd", tracer_provider=tracer_provider)
    return True


def disable_otel() -> None:
    global _tracer
    _tracer = None


def setup_otel_from_env(service_name: str = "epd") -> bool:
    """At a service's start: spans when `EPD_OTEL` is 1/true. With the SDK and the OTLP exporter
    installed and no provider set yet, one is set up (OTEL_EXPORTER_OTLP_* say where to)."""
    if os.environ.get(OTEL_ENV, "").lower() not in ("1", "true", "yes"):
        return False
    if otel_enabled():
        return True
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # type: ignore
        from opentelemetry.sdk.resources import Resource  # type: ignore
        from opentelemetry.sdk.trace import TracerProvider  # type: ignore
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # type: ignore

        if type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider":
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            trace.set_tracer_provider(provider)
    except ImportError:
        log.info(
            "opentelemetry-sdk or its OTLP exporter is not installed: spans go to the process's "
            "own tracer provider, if one was set up (e.g. by opentelemetry-instrument)"
        )
    return enable_otel()


def _start_span(name: str, kind: str, carrier: Mapping[str, str] | None = None) -> Any:
    """A started span (None with OpenTelemetry off); `carrier`: the incoming metadata, whose
    trace context becomes the span's parent."""
    if _tracer is None:
        return None
    from opentelemetry import propagate, trace

    parent = propagate.extract(carrier) if carrier is not None else None
    span = _tracer.start_span(name, context=parent, kind=getattr(trace.SpanKind, kind))
    if current_request_id():
        span.set_attribute("epd.request_id", current_request_id())
    return span


def _make_current(span: Any) -> None:
    """Calls made from here on in this task are children of `span`. Not detached: the task
    (one per RPC or HTTP request) ends with its request."""
    if span is not None:
        from opentelemetry import context, trace

        context.attach(trace.set_span_in_context(span))


def _end_span(span: Any, error: str = "") -> None:
    if span is None:
        return
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def _inject(span: Any, metadata: list[tuple[str, str]]) -> None:
    if span is None:
        return
    from opentelemetry import propagate, trace

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    metadata.extend(carrier.items())


class RequestSpan:
    """A span around one front-door request outside gRPC (the HTTP API); no-op with OTel off."""

    def __init__(self, name: str, carrier: Mapping[str, str] | None = None) -> None:
        self.span = _start_span(name, "SERVER", carrier)
        _make_current(self.span)

    def end(self, error: str = "") -> None:
        _end_span(self.span, error)


# --- gRPC: client side ----------------------------------------------------------------------------


def outgoing_metadata(metadata: Iterable[tuple[str, Any]] | None) -> grpc.aio.Metadata:
    """`metadata` plus the context's request id (unless the caller set one)."""
    out = grpc.aio.Metadata(*tuple(metadata or ()))
    request_id = current_request_id()
    if request_id and REQUEST_ID_KEY not in out:
        out.add(REQUEST_ID_KEY, request_id)
    return out


class _ClientTracing:
    """Adds `x-request-id` (and the span's trace context) to every call of a channel."""

    def _details(self, details: grpc.aio.ClientCallDetails) -> tuple[grpc.aio.ClientCallDetails, Any]:
        metadata = outgoing_metadata(details.metadata)
        method = _method_name(details.method)
        # As the server side: no span for the gateway's health and load polls of each replica,
        # every second on the calls' own channels.
        span = None if method.startswith(UNTRACED_PREFIXES) else _start_span(method, "CLIENT")
        if span is not None:
            extra: list[tuple[str, str]] = []
            _inject(span, extra)
            for k, v in extra:
                metadata.add(k, v)
        return details._replace(metadata=metadata), span  # type: ignore[attr-defined]

    @staticmethod
    def _ended_with(call: Any, span: Any) -> Any:
        if span is not None:
            call.add_done_callback(lambda c: _ENDING.add(asyncio.ensure_future(_end_client_span(c, span))))
        return call


_ENDING: set[asyncio.Future] = set()
"""Client spans being ended (the call's status is read with an await), held until done."""


async def _end_client_span(call: Any, span: Any) -> None:
    try:
        code = grpc.StatusCode.CANCELLED if call.cancelled() else await call.code()
    except Exception:  # noqa: BLE001 - a call that never got a status
        code = grpc.StatusCode.UNKNOWN
    _end_span(span, "" if code == grpc.StatusCode.OK else code.name)
    for done in [f for f in _ENDING if f.done()]:
        _ENDING.discard(done)


class _UnaryUnary(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        details, span = self._details(client_call_details)
        return self._ended_with(await continuation(details, request), span)


class _UnaryStream(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        details, span = self._details(client_call_details)
        return self._ended_with(await continuation(details, request), span)


class _StreamUnary(_ClientTracing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        details, span = self._details(client_call_details)
        return self._ended_with(await continuation(details, request_iterator), span)


class _StreamStream(_ClientTracing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        details, span = self._details(client_call_details)
        return self._ended_with(await continuation(details, request_iterator), span)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """For `grpc.aio.insecure_channel(..., interceptors=...)` of channels that call stages."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


# --- gRPC: server side ----------------------------------------------------------------------------


class _TracedContext:
    """The servicer's context, whose `abort` adds the request id to the message and to the
    trailing metadata; everything else is the real context's."""

    def __init__(self, context: grpc.aio.ServicerContext, call: _CallTrace) -> None:
        self._context = context
        self._call = call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self._call.code = code.name
        # The id in force now: the servicer may have adopted the one its request message names
        # (`adopt_request_id`) since the call began, and the message and metadata must agree.
        self._call.request_id = current_request_id() or self._call.request_id
        metadata = tuple(trailing_metadata or ())
        if self._call.request_id and not metadata_value(metadata):
            metadata = (*metadata, (REQUEST_ID_KEY, self._call.request_id))
        await self._context.abort(
            code, with_request_id(details, self._call.request_id), trailing_metadata=metadata
        )


class _CallTrace:
    """One RPC served: its id, clock, status, span; the INFO line when it ends."""

    def __init__(self, method: str, metadata: Iterable[tuple[str, Any]] | None) -> None:
        self.method = method
        incoming = {
            k: (v.decode("ascii", "replace") if isinstance(v, bytes) else str(v)) for k, v in metadata or ()
        }
        self.request_id = begin_request(incoming.get(REQUEST_ID_KEY, ""))
        self.started = time.perf_counter()
        self.code = "OK"
        self.sent_metadata = False
        self.span = _start_span(method, "SERVER", incoming)
        _make_current(self.span)

    async def send_metadata(self, context: grpc.aio.ServicerContext) -> bool:
        """The id as initial metadata, before the first response message. The id read now: the
        servicer may have adopted the one its request message names (`adopt_request_id`).

        False when the call ended under the send (its client cancelled or its deadline passed as
        the metadata went out): gRPC core then counts the initial metadata as sent while grpc.aio,
        whose send failed, does not, so grpc.aio's next write would send them a second time and
        core refuses it (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, logged by grpc as an error: once in
        a 26,000-request soak). Nothing may be sent on such a call any more."""
        if self.sent_metadata:
            return True
        self.sent_metadata = True
        self.request_id = current_request_id() or self.request_id
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, self.request_id),))
        except grpc.aio.UsageError:
            pass  # the servicer sent its own already (or ended the call); the trailers carry the id
        except Exception:  # noqa: BLE001 - core failed the send (ExecuteBatchError): the call is over
            return False
        return True

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            return  # self.code was set by abort
        gone = isinstance(exc, (asyncio.CancelledError, GeneratorExit))  # the client went away
        self.code = "CANCELLED" if gone else "UNKNOWN"

    def end(self) -> None:
        self.request_id = current_request_id() or self.request_id
        total_ms = (time.perf_counter() - self.started) * 1e3
        log.info("rpc %s %s total_ms=%.1f", self.method, self.code, total_ms)
        _end_span(self.span, "" if self.code == "OK" else self.code)


class ServerTracing(grpc.aio.ServerInterceptor):
    """Sets the request id (metadata `x-request-id`, else a new one) for the handler's task,
    returns it to the client, adds it to abort messages, logs the RPC's end, spans it (OTel)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = _method_name(handler_call_details.method)
        if handler is None or method.startswith(UNTRACED_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata
        behavior = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        )
        if handler.response_streaming and inspect.isasyncgenfunction(behavior):

            async def streaming(request, context):
                call = _CallTrace(method, metadata)
                traced = _TracedContext(context, call)
                try:
                    # aclosing: when gRPC closes this stream (its client went away), the
                    # servicer's generator is closed now, its cleanup run, not left to the GC.
                    async with contextlib.aclosing(behavior(request, traced)) as responses:
                        async for response in responses:
                            if not await call.send_metadata(context):
                                # The call is over: end as one its client cancelled, which sends
                                # nothing more (gRPC's handler takes CancelledError so).
                                raise asyncio.CancelledError
                            yield response
                except BaseException as exc:
                    call.failed(exc)
                    raise
                finally:
                    call.end()

            wrapped: Any = streaming
        else:

            async def unary(request, context):
                call = _CallTrace(method, metadata)
                traced = _TracedContext(context, call)
                try:
                    result = await behavior(request, traced)
                    if not await call.send_metadata(context):
                        raise asyncio.CancelledError  # the call is over (see send_metadata)
                    return result
                except BaseException as exc:
                    call.failed(exc)
                    raise
                finally:
                    call.end()

            wrapped = unary
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
