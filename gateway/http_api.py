"""The OpenAI-compatible HTTP API of the front door (aiohttp), in the gateway's own process and
event loop, calling the same `Pipeline` as the gRPC servicer:

    POST /v1/chat/completions   one user message: text + one video_url / image_url part
                                -> `chat.completion`, or with "stream": true SSE
                                   `chat.completion.chunk`s ending in `data: [DONE]`
    GET  /v1/models             the served model id
    GET  /health                200 when every configured stage answers SERVING on grpc.health
    GET  /metrics               Prometheus text format (gateway/metrics.py)

Request format and options: gateway/openai_protocol.py. Media URL policy: gateway/media_fetch.py.
Errors are OpenAI-style JSON bodies; pipeline errors go through `transport.errors.status_of`,
so a status means the same thing on both APIs. A streamed answer sends its 200 only with the
first token: bad media, limits and refusals still get their own HTTP status.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.media_fetch import load_media
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.openai_protocol import (
    ChatRequest,
    chunk_body,
    completion_body,
    epd_details,
    error_body,
    http_status_of,
    parse_chat_request,
    usage,
)
from gateway.pipeline import AskRequest, AskSummary, Pipeline, PipelineEvent
from gateway.web.routes import add_demo_routes
from stages.contracts import MediaInput, TokenStep
from transport.errors import InvalidRequest, status_of
from transport.server import channel_options

log = logging.getLogger(__name__)

NotServing = Callable[[], Awaitable[list[str]]]
"""Returns the names of the stages that are not serving ([] = healthy)."""

_JSON_OVERHEAD_BYTES = 1 << 20


def json_error(status: int, message: str, error_type: str) -> web.Response:
    return web.json_response(error_body(message, error_type), status=status)


def _exception_response(exc: BaseException) -> web.Response:
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in the HTTP API", exc_info=exc)
    status, error_type = http_status_of(code)
    return json_error(status, message, error_type)


class HttpApi:
    def __init__(
        self,
        config: GatewayConfig,
        pipeline: Pipeline,
        metrics: GatewayMetrics,
        not_serving: NotServing | None = None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = metrics
        self.not_serving = not_serving
        self.started_s = int(time.time())

    def app(self) -> web.Application:
        # A base64 data: URL is 4/3 of the media; the JSON around it is small.
        max_body_bytes = self.config.max_upload_bytes * 4 // 3 + _JSON_OVERHEAD_BYTES
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._middleware])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        add_demo_routes(app, self.config)  # the web demo: GET /, /static/*, /demo/*
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        try:
            if self.config.http.api_key and request.path.startswith("/v1/") and not self._authorized(request):
                response: web.StreamResponse = json_error(
                    401,
                    "missing or wrong API key; send 'Authorization: Bearer <key>'",
                    "authentication_error",
                )
            else:
                response = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
            error_type = "request_too_large" if exc.status == 413 else "invalid_request_error"
            message = exc.text if exc.status == 413 and exc.text else (exc.reason or "error")
            response = json_error(exc.status, message, error_type)
        self.metrics.http_responses.inc(route=route, code=str(response.status))
        return response

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), self.config.http.api_key)

    async def models(self, request: web.Request) -> web.Response:
        name = self.config.http.served_model_name
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": name, "object": "model", "created": self.started_s, "owned_by": "epd"}],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        down = await self.not_serving() if self.not_serving else []
        if down:
            return web.json_response({"status": "unavailable", "not_serving": down}, status=503)
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            chat = parse_chat_request(
                await _read_json(request),
                self.config.http.served_model_name,
                self.config.sampling,
                self.config.generation,
            )
            data = await load_media(chat.media_url, self.config.http.media, self.config.max_upload_bytes)
            ask = AskRequest(
                question=chat.question,
                media=MediaInput(data, hashlib.sha256(data).hexdigest()),
                sampling=chat.sampling,
                generation=chat.generation,
                request_id=uuid.uuid4().hex,
                pruning=chat.pruning,
            )
            events = self.pipeline.ask(ask)
            if chat.stream:
                return await self._stream(request, chat, ask.request_id, events)
            async with aclosing(events):  # type: ignore[type-var]
                async for item in events:
                    if isinstance(item, AskSummary):
                        return web.json_response(completion_body(item, chat.model))
            raise RuntimeError("the pipeline ended without a summary")
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped in status_of
            return _exception_response(exc)

    async def _stream(
        self, request: web.Request, chat: ChatRequest, request_id: str, events: AsyncIterator[PipelineEvent]
    ) -> web.StreamResponse:
        created = int(time.time())
        response: web.StreamResponse | None = None

        async def send(body: dict[str, Any]) -> None:
            assert response is not None
            if chat.include_usage:
                body.setdefault("usage", None)
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")

        try:
            async with aclosing(events):  # type: ignore[type-var]
                async for item in events:
                    if not isinstance(item, (TokenStep, AskSummary)):
                        continue  # stage events have no place in OpenAI's format
                    if response is None:
                        response = web.StreamResponse(
                            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                        )
                        await response.prepare(request)
                        await send(
                            chunk_body(request_id, chat.model, created, {"role": "assistant", "content": ""})
                        )
                    if isinstance(item, TokenStep):
                        if item.token_ids or item.text:
                            await send(
                                chunk_body(
                                    request_id,
                                    chat.model,
                                    created,
                                    {"content": item.text},
                                    token_ids=item.token_ids,
                                )
                            )
                        continue
                    final = chunk_body(request_id, chat.model, created, {}, item.finish_reason or "stop")
                    final["epd"] = epd_details(item)
                    await send(final)
                    if chat.include_usage:
                        await send(
                            {
                                **chunk_body(request_id, chat.model, created, {}),
                                "choices": [],
                                "usage": usage(item),
                            }
                        )
        except ConnectionResetError:
            log.info("client of %s went away mid-stream", request_id)
            return response or web.Response(status=499)
        except Exception as exc:  # noqa: BLE001 - mapped in status_of
            if response is None:
                raise  # nothing sent yet: the caller answers with the error's own status
            code, message = status_of(exc)
            status, error_type = http_status_of(code)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("internal error mid-stream in %s", request_id)
            await response.write(
                b"data: " + json.dumps(error_body(message, error_type, str(status))).encode() + b"\n\n"
            )
        if response is None:
            raise RuntimeError("the pipeline ended without a token")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except json.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None


class StageHealth:
    """grpc.health checks of every configured stage replica (the `/health` answer)."""

    def __init__(self, config: GatewayConfig, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self.addresses = [
            (stage, address)
            for stage, addresses in (
                ("encoder", config.encoder_addresses),
                ("prefill", config.prefill_addresses),
                ("decode", config.decode_addresses),
            )
            for address in addresses
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def not_serving(self) -> list[str]:
        results = await asyncio.gather(*(self._serving(address) for _, address in self.addresses))
        return [f"{stage} {address}" for (stage, address), ok in zip(self.addresses, results) if not ok]

    async def _serving(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=channel_options())
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


@dataclass
class HttpServer:
    runner: web.AppRunner
    port: int
    stage_health: StageHealth | None = None

    async def stop(self) -> None:
        await self.runner.cleanup()
        if self.stage_health is not None:
            await self.stage_health.close()


async def start_http_api(
    config: GatewayConfig,
    pipeline: Pipeline,
    metrics: GatewayMetrics,
    stage_health: StageHealth | None = None,
) -> HttpServer:
    """Serve the HTTP API on `config.http.port` (0 here binds a free port, for tests)."""
    api = HttpApi(config, pipeline, metrics, stage_health.not_serving if stage_health else None)
    # handler_cancellation: a client that disconnects stops its pipeline run.
    runner = web.AppRunner(api.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.http.host or config.server.host, config.http.port)
    await site.start()
    port = runner.addresses[0][1]
    log.info("OpenAI-compatible HTTP API on port %d", port)
    return HttpServer(runner, port, stage_health)
