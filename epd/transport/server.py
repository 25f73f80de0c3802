"""A grpc.aio server with what every epd service needs: health, reflection, message limits,
graceful shutdown. `create_server(config, ...) -> (server, port)` binds port 0 (a free port: `--ports-file` says which);
`run_service(start(config), grace_s)` is a service's whole life in `epd serve ROLE`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from epd.stages.server_config import MAX_MESSAGE_BYTES, ServerConfig
from epd.transport import security, tracing
from epd.transport.auth import InternalSecretInterceptor
from epd.transport.errors import status_of
from epd.transport.idle_memory import release_when_idle
from epd.transport.internal_secrets import follow_secret_file, internal_secrets
from epd.transport.ports_file import write_ports_file

log = logging.getLogger(__name__)


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Message limits of every server and channel. Why 4 MiB (MAX_MESSAGE_BYTES) and not more:
    senders cut everything large into 1 MiB chunks (media uploads in `epd_client` and
    `epd.transport.remote_encode`, tensors in `tensor_wire`), so no legitimate message is near it, while a
    peer's single message is parsed whole in memory before any of our checks runs. Whole-upload
    limits (`--max-upload-bytes`, the gateway's `--max-inflight-body-bytes`) are counted over
    the chunks by the receiver (`epd.transport.upload.read_upload`), never by gRPC."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# A restarted peer is found within seconds rather than after gRPC's default reconnect backoff
# (growing to 120 s): for the gateway's channels to its stages and its health checks of them.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]


def traced_channel(
    target: str, options: Sequence[tuple[str, Any]] | None = None, server_name: str = ""
) -> grpc.aio.Channel:
    """A channel to a stage whose calls carry the caller's request id (`x-request-id`) and, with
    OpenTelemetry on, its trace context (`epd.transport.tracing`); TLS and the internal secret
    as this process was configured (`epd.transport.security.configure`), the certificate checked
    against `server_name` (`security.stage_channel`)."""
    return security.stage_channel(
        target, channel_options() if options is None else options, tracing.client_interceptors(), server_name
    )


LIVENESS_SERVICE = "liveness"
"""A grpc.health service name every epd server answers SERVING from the moment it listens until it
stops: what liveness probes ask (`epd health ADDRESS --service liveness`; Kubernetes `grpc:
{port, service: liveness}`). The whole server's status ("") is readiness: the gateway answers
NOT_SERVING while a stage has no replica serving, and Kubernetes' gRPC livenessProbe, which wants
SERVING, restarted a sound gateway every minute while a stage was down or still loading its model
(CrashLoopBackOff: up to 5 minutes more without a front door once the stages were back)."""


class HealthyServer:
    """A started server plus its health servicer (NOT_SERVING until `set_serving`)."""

    def __init__(self, server: grpc.aio.Server, port: int, service_names: list[str]) -> None:
        self.server = server
        self.port = port
        self.service_names = service_names
        self.health = health.aio.HealthServicer()
        self.background_tasks: list[asyncio.Task] = []  # e.g. waiting for downstream readiness
        self.cut_calls: Callable[[bool], Awaitable[None]] | None = None
        """Ends the calls still in flight when the grace period is over (or at the second signal),
        each with a status of the service's own (the gateway's: ABORTED after tokens, UNAVAILABLE
        before), before gRPC's own stop would cancel them as UNAVAILABLE "Cancelling all calls"."""
        self.closers: list[Callable[[], Awaitable[None] | None]] = []
        """Run by `stop`, in order, once the server has stopped (its calls drained or ended): what
        the service holds beyond the server (its engine core's loop, the encoder's decode pool and
        request drivers, prefill's tokenizer thread, decode's KV channels, and last the model
        thread), closed by its owner rather than left to `os._exit` (`epd serve`) or an atexit
        handler. An async closer is awaited on the loop; a plain one, which may join threads, runs
        off it. One that fails is logged and the rest still run."""

    async def set_serving(self, serving: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    @contextlib.asynccontextmanager
    async def closed_on_failure(self, *closers: Callable[[], None]) -> AsyncIterator[None]:
        """Around the rest of a service's start-up (loading the model): if it fails or is
        cancelled, stop the server before the error leaves the event loop (a grpc.aio server
        left to the garbage collector after `asyncio.run` returns logs "Event loop is closed"
        tracebacks), then close `closers`, what start-up made before it failed (the model thread,
        which `closers` would have closed after a drain; they join threads: run off the loop)."""
        try:
            yield
        except BaseException:
            for task in self.background_tasks:
                task.cancel()
            await self.server.stop(None)
            for close in closers:
                await asyncio.to_thread(close)
            raise

    async def stop(self, grace_s: float) -> None:
        for task in self.background_tasks:
            task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        closers, self.closers = self.closers, []  # once
        for close in closers:
            try:
                if inspect.iscoroutinefunction(close):
                    await close()
                else:
                    await asyncio.to_thread(close)  # it joins threads: not on the event loop
            except Exception:
                log.exception("closing %r after the drain failed", close)


class UnaryRequestParsing(grpc.aio.ServerInterceptor):
    """Parses a one-message request in the handler, where a message that is not protobuf is the
    caller's INVALID_ARGUMENT (`epd.transport.errors.status_of`), not gRPC's own UNKNOWN
    "Unexpected <class 'google.protobuf.message.DecodeError'>" (gRPC parses it before any handler
    runs, and answers what that raises with UNKNOWN). A request stream's messages are parsed as
    the servicer reads them, so `rpc_errors` already maps theirs. Innermost: the handler below
    it gets the parsed request, those above it the bytes. The handler it makes is a coroutine (or
    an async generator), which the interceptors above it await: a synchronous handler (a plain
    `def`, or a generator) runs on a worker thread as gRPC would run it, with its context's
    coroutine methods (`abort`, ...) waited for on the loop (`_ThreadContext`)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        behavior = handler.unary_unary or handler.unary_stream

        async def parsed(request: bytes, context: grpc.aio.ServicerContext):
            try:
                return parse(request)
            except DecodeError as exc:
                await context.abort(*status_of(exc))

        if inspect.isasyncgenfunction(behavior):

            async def streaming(request: bytes, context):
                message = await parsed(request, context)
                async with contextlib.aclosing(behavior(message, context)) as responses:
                    async for response in responses:
                        yield response

            wrapped: Any = streaming
        elif inspect.iscoroutinefunction(behavior):

            async def unary(request: bytes, context):
                return await behavior(await parsed(request, context), context)

            wrapped = unary
        elif handler.response_streaming:

            async def thread_streaming(request: bytes, context):
                message = await parsed(request, context)
                responses = iter(await asyncio.to_thread(behavior, message, _ThreadContext(context)))
                try:
                    while (response := await asyncio.to_thread(next, responses, _END)) is not _END:
                        yield response
                finally:
                    if close := getattr(responses, "close", None):  # a generator's cleanup, now
                        await asyncio.to_thread(close)

            wrapped = thread_streaming
        else:

            async def thread_unary(request: bytes, context):
                message = await parsed(request, context)
                return await asyncio.to_thread(behavior, message, _ThreadContext(context))

            wrapped = thread_unary
        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(wrapped, request_deserializer=None, response_serializer=handler.response_serializer)


_END = object()
"""The end of a synchronous handler's responses (`next`'s default)."""


class _ThreadContext:
    """A grpc.aio call's context as a synchronous handler uses it on its worker thread: what the
    context's methods return is the handler's, but for a coroutine (`abort`,
    `send_initial_metadata`, ...), which runs on the event loop and is waited for, as gRPC's own
    context for a synchronous handler on an aio server does (so `abort` raises here, ending the
    handler with the status it set)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._loop = asyncio.get_running_loop()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._context, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attribute(*args, **kwargs)
            if not inspect.isawaitable(result):
                return result
            return asyncio.run_coroutine_threadsafe(_awaited(result), self._loop).result()

        return call


async def _awaited(result: Awaitable[Any]) -> Any:
    return await result


async def create_server(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    public: bool = False,
    other_ports: Mapping[str, int] | None = None,
) -> HealthyServer:
    """Build and start a server; `register(server)` adds the service's servicers. Every call it
    serves runs under its request id, and every error it answers names it (`tracing.ServerTracing`).
    TLS (mTLS with a client CA) as `config.security` says; a stage (not `public`, unlike the
    gateway) with an internal secret refuses calls without it, health and reflection aside. Once
    it listens, its port (and `other_ports`, the gateway's HTTP API's) goes to `config.ports_file`."""
    # so_reuseport off: gRPC enables it by default on Linux, which lets a second server bind a
    # port already in use and silently share its connections (two models behind one address).
    options = [*channel_options(config.max_message_bytes), ("grpc.so_reuseport", 0)]
    if not public and config.max_connection_age_s > 0:
        # Callers reconnect, and so gRPC resolves a plain Service name again (ServerConfig's doc);
        # the grace after the GOAWAY is left unlimited, so no call in flight is cut.
        options.append(("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)))
    tracing.setup_otel_from_env("epd-" + (service_names[0].rsplit(".", 1)[-1] if service_names else "server"))
    secrets = config.security.accepted_internal_secrets
    guard = [InternalSecretInterceptor(internal_secrets(config.security))] if secrets and not public else []
    credentials = security.server_credentials(config.security)
    server = grpc.aio.server(
        options=options,
        interceptors=[tracing.ServerTracing(), *guard, *interceptors, UnaryRequestParsing()],
    )
    register(server)
    try:
        if credentials is None:
            port = server.add_insecure_port(config.address)
        else:
            port = server.add_secure_port(config.address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"could not bind {config.address}: is another server already using that port?")
    hs = HealthyServer(server, port, service_names)
    health_pb2_grpc.add_HealthServicer_to_server(hs.health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    if config.security.internal_secret_file:  # followed idle too, not only on calls
        follow = follow_secret_file(internal_secrets(config.security))
        hs.background_tasks.append(asyncio.ensure_future(follow))
    await hs.set_serving(False)
    await hs.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    if config.ports_file:
        write_ports_file(config.ports_file, {"grpc": port, **(other_ports or {})})
    return hs


CUT_MARGIN_S = 2.0
"""After a service ends its calls at the end of the grace period (`HealthyServer.cut_calls`), how
long their statuses have to go out before gRPC cancels what is left."""


def stop_signals() -> list[signal.Signals]:
    """The signals that stop a service or the stack gracefully: SIGINT, SIGTERM, and SIGHUP (a
    closed terminal or dropped ssh session, whose default would end the process on the spot: no
    drain, no ordered stop, the launcher's files left) unless it is ignored (`nohup`: then the
    process is meant to outlive its terminal)."""
    out = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        out.append(signal.SIGHUP)
    return out


SAME_STOP_S = 1.0
"""A signal this soon after the first is the same request to stop, not a second one. One stop
often signals a service twice within milliseconds: systemd's default KillMode=control-group (and
`kill` of every pid) signals each process beside the launcher, which passes its own signal on, and
a service whose parent died gets PR_SET_PDEATHSIG's SIGTERM too. Taken as a second signal, it cut
the calls in flight at once (a stream 5 s from its end got UNAVAILABLE) instead of draining them."""


class StopSignals:
    """`stop_signals()` as events: the first asks for a graceful stop (drain in-flight calls for up
    to the grace period), a second one (`SAME_STOP_S` or more later) for an immediate stop.
    Installed before the model loads, so a signal during start-up stops the service at once
    instead of killing it half-built (SIGINT would otherwise end it with a KeyboardInterrupt
    traceback)."""

    def __init__(self, same_stop_s: float = SAME_STOP_S) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self.same_stop_s = same_stop_s
        self._first_at: float | None = None
        loop = asyncio.get_running_loop()
        for sig in stop_signals():
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            self.stop.set()
        elif now - self._first_at >= self.same_stop_s:
            self.hurry.set()


async def run_service(
    start: Awaitable[HealthyServer], grace_s: float, on_stop: Callable[[], None] | None = None
) -> None:
    """Start a service (`start` is its `start(config)`), serve until SIGINT/SIGTERM, drain, stop.
    A signal during start-up cancels it; `start` must then close what it opened (see
    `HealthyServer.closed_on_failure`). Start-up errors (a model that cannot be loaded) propagate."""
    signals = StopSignals()
    starting = asyncio.ensure_future(start)
    stopper = asyncio.ensure_future(signals.stop.wait())
    try:
        await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("stopped during start-up")
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return
        await serve_until_signal(starting.result(), grace_s, on_stop, signals)
    finally:
        stopper.cancel()


async def serve_until_signal(
    hs: HealthyServer,
    grace_s: float,
    on_stop: Callable[[], None] | None = None,
    signals: StopSignals | None = None,
    drain_too: Callable[[float, asyncio.Event], Awaitable[None]] | None = None,
) -> None:
    """Run until SIGINT/SIGTERM, then drain in-flight calls (at most `grace_s`; a second signal
    cuts it short) and stop. An idle server stops at once: gRPC waits only for open calls.
    `drain_too(grace_s, hurry)` stops another server of the process (the gateway's HTTP API) at
    the same time, cutting its calls short once `hurry` (the second signal) is set."""
    signals = signals or StopSignals()
    waiter = asyncio.ensure_future(hs.server.wait_for_termination())
    stopper = asyncio.ensure_future(signals.stop.wait())
    # Memory back to its idle level once the process goes idle (epd/transport/idle_memory.py).
    releaser = asyncio.ensure_future(release_when_idle())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    releaser.cancel()
    log.info("shutting down (grace %.1f s)", grace_s)

    # With cut_calls gRPC's own grace runs a little longer than ours: the calls are ended by the
    # service first, at grace_s, each with its own status.
    grpc_grace_s = grace_s + (CUT_MARGIN_S if hs.cut_calls else 0.0)

    async def drain() -> None:
        await asyncio.gather(
            hs.stop(grpc_grace_s), *([drain_too(grace_s, signals.hurry)] if drain_too else [])
        )

    draining = asyncio.ensure_future(drain())
    hurry = asyncio.ensure_future(signals.hurry.wait())
    await asyncio.wait(
        [draining, hurry], timeout=grace_s if hs.cut_calls else None, return_when=asyncio.FIRST_COMPLETED
    )
    if not draining.done():
        if hs.cut_calls is not None:
            log.info(
                "%s: ending the calls still in flight",
                "second signal" if hurry.done() else "grace period over",
            )
            await hs.cut_calls(hurry.done())  # True: a second signal, not the grace period, ended the drain
            await asyncio.wait([draining, hurry], timeout=CUT_MARGIN_S, return_when=asyncio.FIRST_COMPLETED)
        if not draining.done():
            log.info("aborting the calls still in flight")
            await hs.server.stop(None)  # a shorter grace overrides the pending one
        await draining
    hurry.cancel()
    if on_stop:
        on_stop()
    stopper.cancel()
    waiter.cancel()
