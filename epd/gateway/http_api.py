"""The OpenAI-compatible HTTP API of the front door (aiohttp), in the gateway's own process and
event loop, calling the same `Pipeline` as the gRPC servicer:

    POST /v1/chat/completions   messages (system/user/assistant) whose parts, in order, are text
                                and one video_url / image_url part
                                -> `chat.completion`, or with "stream": true SSE
                                   `chat.completion.chunk`s ending in `data: [DONE]` (with
                                   stream_options include_usage, a last usage chunk; with
                                   vLLM's continuous_usage_stats too, the usage so far on each)
    POST /v1/responses          OpenAI's Responses API over the same conversation model
                                (epd/gateway/responses_protocol.py) -> a `response`, or with
                                "stream": true its semantic SSE events (`event: response.created`
                                ... `response.completed`)
    POST /v1/completions        legacy completions: one raw prompt (text or token ids), no chat
                                template (epd/gateway/completions_protocol.py) -> `text_completion`,
                                streamed as chat's is, in `text_completion` chunks
    GET  /v1/models             the served model id and its max_model_len (and /v1/models/{id}:
                                it alone, or 404)
    POST /tokenize              vLLM's: a prompt's or a text-only conversation's token ids, count
                                and max_model_len (POST /detokenize: ids -> text); by prefill
                                (epd/gateway/tokenize_api.py)
    GET  /health                200 when every configured stage answers SERVING on grpc.health
                                (GET or POST /ping: the same, as vLLM's)
    GET  /version               {"version": epd's}
    GET  /metrics               Prometheus text format (epd/gateway/metrics.py)

Request format and options: epd/gateway/chat_request.py. Media URL policy: epd/gateway/media_fetch.py.
Errors are OpenAI-style JSON bodies, aiohttp's own too (an unknown path's 404, a wrong method's
405 with its Allow header, an unsupported Expect's 417: a catch-all route keeps every request
inside the middleware); pipeline errors go through `epd.transport.errors.status_of`,
so a status means the same thing on both APIs. A streamed answer sends its 200 only with the
first token, or with the first SSE keep-alive comment (`--sse-keepalive`, after 15 s without a
token): bad media, limits and refusals before then still get their own HTTP status.

Bodies are JSON sent as `Content-Type: application/json` (else 415 before they are read, as vLLM
refuses them), read under limits (epd/gateway/http_body.py): 413 past the body limit (derived from
--max-upload-bytes) without reading the rest, 429 + Retry-After when the client already has
--max-requests-per-client requests in flight or the process holds --max-inflight-body-bytes of
bodies (epd/gateway/admission.py, shared with the gRPC API), 408 when the body has not all
arrived within --body-timeout.

Every request runs under a request id (epd/transport/tracing.py): the client's `x-request-id`
header when usable, else the body's (vLLM's) `request_id` when usable, else a new one. It is the pipeline's request id (so every stage logs it), it
comes back in the `x-request-id` response header, and every error message ends with it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from epd import __version__
from epd.gateway.admission import (
    RETRY_AFTER_S,
    Admission,
    Overloaded,
    max_body_bytes,
    peer_host,
)
from epd.gateway.ask_types import AskRequest, AskSummary, PipelineEvent
from epd.gateway.browser_guard import cross_site_browser_request, rebound_host
from epd.gateway.chat_answer import completion_body
from epd.gateway.chat_chunks import ChatChunks
from epd.gateway.chat_request import ChatRequest, parse_chat_request
from epd.gateway.completions_protocol import (
    parse_completion_request,
    text_completion_body,
)
from epd.gateway.config import GatewayConfig
from epd.gateway.http_body import (
    AIOHTTP_HANDLER_ARGS,
    SUPPORTED_ENCODINGS,
    TICKET_KEY,
    defer_continue,
    not_json_content_type,
    not_json_content_type_message,
    read_json_body,
    unsupported_encoding,
    unsupported_encoding_message,
    unsupported_expect,
)
from epd.gateway.http_errors import error_body, http_error_of
from epd.gateway.json_answer import json_answer
from epd.gateway.media_fetch import decode_data_url, load_media
from epd.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.protocol_log import CLIENT_FAULTS, PROTOCOL_LOG
from epd.gateway.readiness import InProcessHealth, StageHealth
from epd.gateway.reasoning import (
    MarkerIds,
    constrained_after_reasoning,
    marker_ids,
    parser_misfit,
    thinking_on,
)
from epd.gateway.responses_events import ResponseEvents, response_body
from epd.gateway.responses_protocol import parse_responses_request
from epd.gateway.shutdown import CallsInFlight
from epd.gateway.sse_stream import (
    STREAM_BEGUN_KEY,
    STREAM_ERROR_KEY,
    SseStream,
    write_chat_events,
    write_response_events,
)
from epd.gateway.tokenize_api import add_tokenize_routes
from epd.gateway.tool_request import check_auto_tool_choice
from epd.gateway.web.routes import BODY_ROUTES, add_demo_routes
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput, TokenStep
from epd.stages.errors import InvalidRequest, ServerMisconfigured
from epd.stages.raw_prompt import check_raw_prompt
from epd.transport import tracing
from epd.transport.auth import any_key_matches, bearer_token, request_cache_salt
from epd.transport.internal_secrets import internal_secrets
from epd.transport.security import server_ssl_context
from epd.transport.server import CUT_MARGIN_S
from epd.video.types import SamplingOptions

log = logging.getLogger(__name__)

UNROUTED = "unmatched"
"""Name of the catch-all route, and the route label of requests it answers (metrics, logs)."""

KEYED_PATH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/invocations", "/tokenize", "/detokenize")
"""With --api-key, a path starting with one of these needs the key whether or not a route takes it
(plain prefixes, as vLLM's AuthenticationMiddleware matches them): vLLM guards /v1, /v2, /inference
and /cohere always and the prefix of every route it registers (/invocations, /tokenize), so a
client without the key gets vLLM's 401 before a 404 for a vLLM path epd does not serve
(/v1/embeddings, /invocations), and a path no vLLM serving a generative model has (/pooling,
/classify, /sleep) a 404 there and here. Besides these, the POSTs of `BODY_ROUTES` (the web demo's)."""

NotServing = Callable[[], Awaitable[list[str]]]
"""Returns the names of the stages that are not serving ([] = healthy)."""

ParseRequest = Callable[[Any, str, SamplingOptions, GenerationConfig], ChatRequest]
"""A route's body parser (chat's, legacy completions'): (body, served model, defaults) -> request."""


def json_error(status: int, message: str, error_type: str) -> web.Response:
    """An OpenAI-style error; its message names the request id (`tracing.with_request_id`)."""
    response = web.json_response(
        error_body(tracing.with_request_id(message), error_type, status), status=status
    )
    if status == 429:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def aiohttp_error_response(exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusal (an unknown route, a wrong method, a body too large) as an
    OpenAI-style JSON error; a 405 keeps its Allow header (the methods the path takes)."""
    error_type = "request_too_large" if exc.status == 413 else "invalid_request_error"
    message = exc.text if exc.status == 413 and exc.text else (exc.reason or "error")
    response = json_error(exc.status, message, error_type)
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


def exception_response(exc: BaseException) -> web.Response:
    """The JSON error answer to a request that raised `exc` (a 500 logged with its traceback)."""
    status, error_type, message = http_error_of(exc)
    if status == 500:
        log.exception("internal error in the HTTP API", exc_info=exc)
    return json_error(status, message, error_type)


class HttpApi:
    def __init__(
        self,
        config: GatewayConfig,
        pipeline: Pipeline,
        metrics: GatewayMetrics,
        not_serving: NotServing | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = metrics
        self.not_serving = not_serving
        self.admission = admission or Admission.of_gateway(config)
        self.max_body_bytes = max_body_bytes(config.max_upload_bytes)
        self.started_s = int(time.time())
        self.in_flight = CallsInFlight()
        """The requests answering now, ended with their own status at shutdown (`epd/gateway/shutdown.py`)."""
        self._reasoning_misfit_logged = False
        self._text_count_logged = False  # `_marker_ids`: reasoning tokens counted by their text

    def app(self) -> web.Application:
        # client_max_size only backs up read_json_body for any route that calls request.read().
        # handler_args: bodies as they came; gzip and deflate are inflated by read_json_body.
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[self._middleware],
            handler_args=AIOHTTP_HANDLER_ARGS,
        )
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=defer_continue)
        app.router.add_post("/v1/completions", self.completions, expect_handler=defer_continue)
        app.router.add_post("/v1/responses", self.responses, expect_handler=defer_continue)
        app.router.add_get("/v1/models", self.models, expect_handler=defer_continue)
        app.router.add_get("/v1/models/{model:.+}", self.model, expect_handler=defer_continue)
        app.router.add_get("/health", self.health, expect_handler=defer_continue)
        # vLLM's too: /ping is /health by the name SageMaker's probes use (GET and POST), /version
        # says which epd answers (the same open routes as /health: no API key).
        app.router.add_get("/ping", self.health, expect_handler=defer_continue)
        app.router.add_post("/ping", self.health, expect_handler=defer_continue)
        app.router.add_get("/version", self.version, expect_handler=defer_continue)
        app.router.add_get("/metrics", self.prometheus, expect_handler=defer_continue)
        add_tokenize_routes(app, self)  # POST /tokenize, /detokenize (vLLM's), answered by prefill
        add_demo_routes(app, self.config, self.max_body_bytes)  # the web demo: GET /, /static/*, /demo/*
        # Last: every other path. aiohttp answers an unrouted request's Expect header itself, before
        # any middleware (plain text, no request id); a route of ours keeps it in the middleware.
        app.router.add_route("*", "/{path:.*}", self._unrouted, name=UNROUTED, expect_handler=defer_continue)
        return app

    async def cut_requests_in_flight(self, timeout_s: float, hurried: bool = False) -> None:
        """End every request still being answered (the grace period is over): its pipeline run is
        cancelled, and it answers 503, or a streamed answer ends with an error event and [DONE]."""
        await self.in_flight.cut_and_wait(timeout_s, hurried)

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        with self.in_flight.tracking():
            return await self._answer(request, handler)

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        """A request's answer: refused before its handler runs (`_refusal`), or admitted (a body
        route's ticket) and handled; a cancel answered as the stop's 503 when it may be
        (`_cut_response`), aiohttp's own refusals as JSON errors; then recorded (`_answered`)."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None and resource.name != UNROUTED else UNROUTED
        request_id = tracing.begin_request(request.headers.get(tracing.REQUEST_ID_KEY, ""))
        span = tracing.RequestSpan(f"{request.method} {route}", request.headers)
        started = time.perf_counter()
        ticket = None
        try:
            if (refusal := self._refusal(request, route)) is not None:
                response: web.StreamResponse = refusal
            elif request.method == "POST" and route in BODY_ROUTES:
                # With API keys, also counted per key (checked in `_refusal`): a tenant on many IPs.
                key = bearer_token([("authorization", request.headers.get("Authorization", ""))])
                ticket = request[TICKET_KEY] = self.admission.admit(
                    peer_host(request.remote or "unknown"), key if self.config.http.api_keys else ""
                )
                response = await handler(request)
            else:
                response = await handler(request)
        except Overloaded as exc:
            response = exception_response(exc)
        except asyncio.CancelledError:
            if (cut := self._cut_response(request, route, request_id)) is None:
                raise
            response = cut
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
            response = aiohttp_error_response(exc)
        finally:
            if ticket is not None:
                ticket.close()
        self._answered(request, route, request_id, response, started, span)
        return response

    def _refusal(self, request: web.Request, route: str) -> web.Response | None:
        """The error a request gets before its handler runs (None: it may run), in this order: an
        Expect other than 100-continue, a rebound host name, a cross-site browser's POST, a missing
        or wrong API key, a content coding or (a body route's) content type not taken."""
        if unsupported_expect(request):
            return json_error(
                417, "the only Expect this server supports is 100-continue", "invalid_request_error"
            )
        if rebound_host(request, self.config):
            return json_error(
                403,
                "this gateway has no API key and serves loopback clients only: address it as localhost "
                "or 127.0.0.1 (a proxy in front of it needs --api-key, or --no-api-key on a closed network)",
                "permission_error",
            )
        if request.method == "POST" and route in BODY_ROUTES and cross_site_browser_request(request):
            return json_error(
                403,
                "a page of another site may not call this server from a browser; call the API from "
                "your server, or use this server's own page",
                "permission_error",
            )
        if (
            self.config.http.api_keys
            and (request.path.startswith(KEYED_PATH_PREFIXES) or route in BODY_ROUTES)
            and not self._authorized(request)
        ):  # the web demo's POST too: it decodes media
            return json_error(
                401,
                "missing or wrong API key; send 'Authorization: Bearer <key>'",
                "authentication_error",
            )
        if (encoding := unsupported_encoding(request)) is not None:
            response = json_error(415, unsupported_encoding_message(encoding), "invalid_request_error")
            # RFC 9110 15.5.16: a 415 for a content coding names the codings the server takes.
            response.headers["Accept-Encoding"] = ", ".join(SUPPORTED_ENCODINGS)
            return response
        if (
            request.method == "POST"
            and route in BODY_ROUTES
            and (content_type := not_json_content_type(request)) is not None
        ):
            return json_error(415, not_json_content_type_message(content_type), "invalid_request_error")
        return None

    def _cut_response(self, request: web.Request, route: str, request_id: str) -> web.Response | None:
        """The answer to a request whose handler was cancelled: a 503 when the gateway's stop cut it
        before its answer began; None when the cancel must go on (its stream's 200 is out, or its
        client went away), counted in the metrics here."""
        if self.in_flight.cutting and not request.get(STREAM_BEGUN_KEY):
            # The gateway's stop cut it at the end of the grace period (`CallsInFlight.cut`),
            # whatever the route (/health, /metrics, the web demo's decode, a chat not begun):
            # a 503 to retry, counted as one. It was counted as a client gone (499) and its
            # connection dropped.
            return exception_response(
                self.in_flight.shutdown_error(0, tracing.current_request_id() or request_id)
            )
        if self.in_flight.cutting:  # a stream whose 200 is out: only its connection can end
            self.metrics.http_responses.labels(route=route, code="200").inc()
            return None
        # Its client went away (aiohttp cancels the handler, `handler_cancellation`): nobody
        # reads an answer, the cancel goes on; one INFO line and a 499 in the metrics, as
        # for a client found gone by a read or a write (`client_gone_response`).
        log.info("client of %s went away", tracing.current_request_id() or request_id)
        self.metrics.http_responses.labels(route=route, code="499").inc()
        return None

    def _answered(
        self,
        request: web.Request,
        route: str,
        request_id: str,
        response: web.StreamResponse,
        started: float,
        span: tracing.RequestSpan,
    ) -> None:
        """A request's answer, recorded: its x-request-id header, its log line (a POST's), its
        trace span's end, its connection closed when its body was left unread, its metric."""
        if not response.prepared:  # a streamed answer has it already (`SseStream.begin`)
            # The handler may have adopted the id its body names (`ChatRequest.request_id`).
            response.headers[tracing.REQUEST_ID_KEY] = tracing.current_request_id() or request_id
        if request.method == "POST":
            # A streamed answer that failed after its 200 says so here too, with the error's status.
            stream_error = f" stream_error={request[STREAM_ERROR_KEY]}" if STREAM_ERROR_KEY in request else ""
            log.info(
                "http %s %s %d%s total_ms=%.1f",
                request.method,
                route,
                response.status,
                stream_error,
                (time.perf_counter() - started) * 1e3,
            )
        span.end(
            str(request[STREAM_ERROR_KEY])
            if STREAM_ERROR_KEY in request
            else ""
            if response.status < 400
            else str(response.status)
        )
        if not response.prepared and request.can_read_body:
            # Refused before its body was read: the connection cannot carry another request
            # (aiohttp drops what is still arriving for a few seconds, then closes it).
            response.force_close()
        self.metrics.http_responses.labels(route=route, code=str(response.status)).inc()

    async def _unrouted(self, request: web.Request) -> web.StreamResponse:
        """A path no route of ours takes with this method: 405 where another method would be taken
        (the router passed over that route to reach this one), else 404."""
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource.name != UNROUTED:
                allowed |= (await resource.resolve(request))[1]
        if allowed:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        raise web.HTTPNotFound()

    def _authorized(self, request: web.Request) -> bool:
        token = bearer_token([("authorization", request.headers.get("Authorization", ""))])
        return any_key_matches(token, self.config.http.api_keys)

    def _model_object(self) -> dict[str, Any]:
        """vLLM's model card (`ModelCard`): its `max_model_len` is the longest prompt plus answer a
        request may have (`ModelInfo.max_model_len`), null until prefill has said (the stack's
        gateway at start); `root` the served model's name (vLLM's is the weights' path, which the
        gateway neither knows in a stack nor shows: a local path stays in the server's log),
        `parent` null (no adapters), `permission` vLLM's one default `ModelPermission`, as vLLM's
        `show_available_models` fills them."""
        name = self.config.http.served_model_name
        info = self.pipeline.model_info()
        return {
            "id": name,
            "object": "model",
            "created": self.started_s,
            "owned_by": "epd",
            "root": name,
            "parent": None,
            "max_model_len": None if info is None else info.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": int(time.time()),
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve-model: the served model, or 404 as for a request naming another."""
        if request.match_info["model"] != self.config.http.served_model_name:
            return json_error(
                404,
                f"model '{request.match_info['model'][:200]}' is not served here; GET "
                f"/v1/models lists '{self.config.http.served_model_name}'",
                "not_found_error",
            )
        return web.json_response(self._model_object())

    async def health(self, request: web.Request) -> web.Response:
        down = await self.not_serving() if self.not_serving else []
        if down:
            return web.json_response({"status": "unavailable", "not_serving": down}, status=503)
        return web.json_response({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=await self.metrics.scrape(), headers={"Content-Type": CONTENT_TYPE})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_chat_request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Legacy completions: a raw prompt, no chat template (`epd.gateway.completions_protocol`)."""
        return await self._complete(request, parse_completion_request)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: its body read as a chat request (`epd.gateway.responses_protocol`)."""
        return await self._complete(request, parse_responses_request)

    async def _complete(self, request: web.Request, parse: ParseRequest) -> web.StreamResponse:
        """A chat, legacy completion or Responses request: its body read and checked, its media
        loaded, the pipeline asked, and its answer streamed or sent whole."""
        try:
            chat = await self._read_request(request, parse)
            ask = self._ask_request(request, chat, await self._load_media(request, chat))
            events = self.pipeline.ask(ask)
            if chat.stream:
                return await self._stream(request, chat, ask.request_id, events)
            return await self._whole_answer(chat, events)
        except ConnectionResetError:
            # Its client closed the connection while sending its body: nothing to answer, and not
            # the server's fault (it was an ERROR traceback and a 500 for every such client).
            return client_gone_response(tracing.current_request_id(), "before its body arrived")
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped in status_of
            return exception_response(exc)

    async def _read_request(self, request: web.Request, parse: ParseRequest) -> ChatRequest:
        """The request's body, read under its limits and parsed by the route's `parse`; a chat
        request checked against the server's reasoning and tool parsers, which it takes on; a
        token-id prompt to echo given its text."""
        body = await read_json_body(request, self.max_body_bytes, self.config.body_timeout_s)
        if isinstance(body, dict) and isinstance(body.get("request_id"), str):
            # Before the body is checked: a 400 for one of its fields names the client's id.
            tracing.adopt_request_id(body["request_id"])
        chat = parse(
            body,
            self.config.http.served_model_name,
            self.config.sampling,
            self.pipeline.generation_defaults(self.config.generation),
        )
        if chat.raw_prompt is None:  # legacy completions are not parted: they go on working
            self._check_reasoning_parser()
            check_auto_tool_choice(chat.tool_choice, self.config.http.enable_auto_tool_choice)
            if self.config.http.tool_call_parser:  # how "auto" reads the answer's calls
                chat.tool_choice = replace(chat.tool_choice, parser=self.config.http.tool_call_parser)
            if self.config.http.reasoning_parser:
                chat.generation = constrained_after_reasoning(chat.generation)
        elif chat.echo and chat.raw_prompt.token_ids:
            # vLLM's renderer decodes a token-id prompt that is to be echoed; the gateway holds no
            # tokenizer, prefill does (a Detokenize call, made only for echo). Ids outside the
            # vocabulary are refused first as the prompt's, not as Detokenize's 'tokens'.
            check_raw_prompt(chat.raw_prompt, vocab_size=self.pipeline.vocab_size)
            chat.prompt_ids_text = await self.pipeline.detokenize(
                chat.raw_prompt.token_ids, tracing.current_request_id()
            )
        return chat

    async def _load_media(self, request: web.Request, chat: ChatRequest) -> MediaInput | None:
        """The media `chat` names (None: a text-only conversation, no encoder call): a data: URL's
        bytes, a local file's or a fetched URL's (held on the request's ticket), and their hash."""
        # Decoding and hashing take about 1 s per 64 MB of media: on a worker thread, so that the
        # event loop (every other client's stream, both APIs) goes on meanwhile.
        data = None
        if chat.media_url.startswith("data:"):
            data = await asyncio.to_thread(take_data_url_bytes, chat, self.config.max_upload_bytes)
        elif chat.media_url:
            # a file's or a fetch's bytes count as a body's
            ticket = request.get(TICKET_KEY)
            data = await load_media(
                chat.media_url,
                self.config.http.media,
                self.config.max_upload_bytes,
                ticket.reserve_bytes if ticket is not None else None,
            )
        return None if data is None else MediaInput(data, await asyncio.to_thread(sha256_hex, data))

    def _ask_request(self, request: web.Request, chat: ChatRequest, media: MediaInput | None) -> AskRequest:
        """The pipeline's request for `chat`, under the id its body names (when usable) and the
        prefix cache's salt of its API key and `cache_salt`."""
        return AskRequest(
            messages=chat.messages,
            media=media,
            sampling=chat.sampling,
            generation=chat.generation,
            request_id=tracing.adopt_request_id(chat.request_id),
            pruning=chat.pruning,
            raw_prompt=chat.raw_prompt,
            template=chat.template,
            cache_salt=request_cache_salt(
                bool(self.config.http.api_keys),
                bearer_token([("authorization", request.headers.get("Authorization", ""))]),
                chat.cache_salt,
                internal_secrets(self.config.server.security).presented,
            ),
        )

    async def _whole_answer(self, chat: ChatRequest, events: AsyncIterator[PipelineEvent]) -> web.Response:
        """The answer sent whole, at its end: a Responses answer's, shaped from its steps
        (`response_body`); a chat answer's with a reasoning parser, parted and its reasoning
        tokens counted from them in one pass (`completion_body`); a legacy completion's."""
        thinking = self._thinking(chat)
        steps: list[TokenStep] = []
        async with aclosing(events):  # type: ignore[type-var]
            async for item in events:
                if isinstance(item, TokenStep) and (chat.responses is not None or thinking is not None):
                    steps.append(item)
                if isinstance(item, AskSummary):
                    log_summary(item)
                    build = self._answer_body(chat, item, thinking, steps)
                    # the prompt's logprobs: up to half a million entries, written off the loop
                    return await json_answer(build, off_loop=bool(item.prompt_logprobs))
        raise RuntimeError("the pipeline ended without a summary")

    def _answer_body(
        self, chat: ChatRequest, summary: AskSummary, thinking: bool | None, steps: list[TokenStep]
    ) -> Callable[[], dict[str, Any]]:
        """What builds the whole answer's body (on a worker thread when it is large)."""
        if chat.raw_prompt is not None:
            return functools.partial(text_completion_body, summary, chat)
        if chat.responses is not None:
            return functools.partial(
                response_body, summary, chat, thinking, steps, marker_ids=self._marker_ids(thinking)
            )
        return functools.partial(
            completion_body,
            summary,
            chat.model,
            role=chat.response_role,
            echoed=chat.echoed_text,
            thinking=thinking,
            include_reasoning=chat.include_reasoning,
            tool_choice=chat.tool_choice,
            steps=steps,
            marker_ids=self._marker_ids(thinking),
            return_token_ids=chat.return_token_ids,
        )

    def _check_reasoning_parser(self) -> None:
        """ServerMisconfigured (HTTP 500) for a chat request under a `--reasoning-parser` that the
        served model's tokenizer cannot be parted by (`parser_misfit`), before its media costs an
        encode; the first such refusal logs the reason as an ERROR, for the operator."""
        misfit = parser_misfit(self.config.http.reasoning_parser, self.pipeline.model_info())
        if misfit is None:
            return
        if not self._reasoning_misfit_logged:
            self._reasoning_misfit_logged = True
            log.error("refusing chat requests: %s", misfit)
        raise ServerMisconfigured(misfit)

    def _marker_ids(self, thinking: bool | None) -> MarkerIds | None:
        """The served model's think markers' token ids, by which a thinking answer's reasoning
        tokens are counted (`epd.gateway.reasoning.marker_ids`; None without a parser). Not known
        (no model info yet, a prefill from before them, replicas that disagree), they are counted
        by where the text falls, which the first such answer logs once, for the operator; each
        answer reads them afresh, so those after they come are counted by id."""
        if thinking is None:
            return None
        ids = marker_ids(self.pipeline.model_info(), self.config.http.reasoning_parser)
        if ids is None and not self._text_count_logged:
            self._text_count_logged = True
            log.warning(
                "counting reasoning tokens by where the answer's text falls, not by token id: prefill has "
                "not reported the token ids of <think> and </think> (no model info yet, a prefill from "
                "before them, or replicas whose ids differ); usage's reasoning_tokens may differ from vLLM's"
            )
        return ids

    def _thinking(self, chat: ChatRequest) -> bool | None:
        """With `--reasoning-parser`, whether `chat`'s answer begins inside a thinking block
        (`epd.gateway.reasoning.thinking_on`); None without one, or for a legacy completion
        (vLLM parts chat answers alone). A structured output's grammar starts after the model's
        `</think>` (`constrained_after_reasoning`), so its answer is parted as any other."""
        parser = self.config.http.reasoning_parser
        if not parser or chat.raw_prompt is not None:
            return None
        return thinking_on(parser, chat.template.chat_template_kwargs)

    async def _stream(
        self, request: web.Request, chat: ChatRequest, request_id: str, events: AsyncIterator[PipelineEvent]
    ) -> web.StreamResponse:
        stream = SseStream(request, request_id, self.in_flight, self.config.http.sse_keepalive_s)
        thinking = self._thinking(chat)
        ids = self._marker_ids(thinking)
        if chat.responses is not None:
            shaper = ResponseEvents(chat, request_id, thinking, marker_ids=ids)
            write = write_response_events(stream, shaper, events, log_summary)
        else:
            write = write_chat_events(
                stream, ChatChunks(chat, request_id, thinking, ids), events, log_summary
            )
        try:
            await stream.run(write)
        except ConnectionResetError:
            # Any write may find the client gone, the last ([DONE], the end of the chunked body)
            # too: that was an ERROR traceback and a 500 for a client that had read its answer.
            return client_gone_response(request_id, "mid-stream", stream.response)
        assert stream.response is not None
        return stream.response


def client_gone_response(
    request_id: str, when: str, response: web.StreamResponse | None = None
) -> web.StreamResponse:
    """What a handler returns for a client that closed its connection: one INFO line, and the
    response it had begun, or a 499 (nginx's "client closed request") that nobody reads."""
    log.info("client of %s went away %s", request_id, when)
    return response or web.Response(status=499)


def log_summary(summary: AskSummary) -> None:
    """The request's per-stage timings, one INFO line (its request id added by the log filter)."""
    timings = {f"{name}_ms": float(ms) for name, ms in summary.timings_ms.items()}
    tracing.stage_timings(
        log,
        "request done",
        **timings,
        num_tokens=sum(len(choice.token_ids) for choice in summary.all_choices()),  # every choice's
        finish_reason=summary.finish_reason,
    )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # hashlib lets go of the GIL while it hashes


def take_data_url_bytes(chat: ChatRequest, max_upload_bytes: int) -> bytes:
    """The media of a base64 data: URL with few copies of a URL that may be hundreds of MB: its
    ASCII bytes replace the text (taken out of `chat`, so the text is freed) and are decoded in
    place (`epd.gateway.media_fetch.decode_data_url`)."""
    try:
        url = chat.media_url.encode("ascii")
    except UnicodeEncodeError:
        raise InvalidRequest("the data: URL must be ASCII: data:video/mp4;base64,<payload>") from None
    chat.media_url = ""
    return decode_data_url(url, max_upload_bytes)


@dataclass
class HttpServer:
    runner: web.AppRunner
    port: int
    api: HttpApi
    stage_health: StageHealth | InProcessHealth | None = None

    async def stop(self, grace_s: float = 0.0, hurry: asyncio.Event | None = None) -> None:
        """Stop listening, give the requests in flight `grace_s` (until `hurry` is set, the second
        signal), then cut the rest. aiohttp's own drain (`shutdown_timeout`) waits that long, then
        only cancels a request's body reading and waits as long again: a streamed answer ran on
        for twice the grace period, and a second signal did not shorten it."""
        cleanup = asyncio.ensure_future(self.runner.cleanup())
        waits: list[asyncio.Future] = [cleanup]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        if not cleanup.done():
            await self.api.cut_requests_in_flight(CUT_MARGIN_S, hurried=hurry is not None and hurry.is_set())
        await cleanup
        for wait in waits[1:]:
            wait.cancel()
        if self.stage_health is not None:
            await self.stage_health.close()


async def start_http_api(
    config: GatewayConfig,
    pipeline: Pipeline,
    metrics: GatewayMetrics,
    stage_health: StageHealth | InProcessHealth | None = None,
    admission: Admission | None = None,
) -> HttpServer:
    """Serve the HTTP API on `config.http.port` (0 binds a free port: `HttpServer.port`);
    `admission` is shared with the gRPC API so that a client's limit counts both."""
    api = HttpApi(config, pipeline, metrics, stage_health.not_serving if stage_health else None, admission)
    # handler_cancellation: a client that disconnects stops its pipeline run.
    # logger: a client's malformed request is one INFO line there, not an ERROR traceback, and
    # at most one a minute.
    CLIENT_FAULTS.reset()
    runner = web.AppRunner(
        api.app(),
        access_log=None,
        handler_cancellation=True,
        logger=PROTOCOL_LOG,
        shutdown_timeout=config.server.grace_s,
    )  # `HttpServer.stop` cuts it short
    await runner.setup()
    # TLS with the gateway's --tls-cert/--tls-key (client certificates with --tls-client-ca).
    site = web.TCPSite(
        runner,
        config.http.host or config.server.host,
        config.http.port,
        ssl_context=server_ssl_context(config.server.security),
    )
    await site.start()
    port = runner.addresses[0][1]
    log.info("OpenAI-compatible HTTP API on port %d", port)
    return HttpServer(runner, port, api, stage_health)
