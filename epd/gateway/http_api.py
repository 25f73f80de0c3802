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

Beside it: the checks a request passes before its handler (http_checks.py), a request's media
loaded (http_media.py), the error responses (http_error_responses.py), and the server that serves
this app and stops it (http_server.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from epd import __version__
from epd.gateway import http_checks
from epd.gateway.admission import (
    Admission,
    Overloaded,
    max_body_bytes,
    peer_host,
)
from epd.gateway.ask_types import AskRequest, AskSummary, PipelineEvent
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
    TICKET_KEY,
    defer_continue,
    read_json_body,
)
from epd.gateway.http_error_responses import aiohttp_error_response, exception_response, json_error
from epd.gateway.http_media import load_request_media
from epd.gateway.json_answer import json_answer
from epd.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from epd.gateway.pipeline import Pipeline
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
from epd.stages.errors import ServerMisconfigured
from epd.stages.raw_prompt import check_raw_prompt
from epd.stages.request_id import current_request_id
from epd.transport import tracing
from epd.transport.auth import bearer_token, request_cache_salt
from epd.transport.internal_secrets import internal_secrets
from epd.video.types import SamplingOptions

log = logging.getLogger(__name__)

UNROUTED = "unmatched"
"""Name of the catch-all route, and the route label of requests it answers (metrics, logs)."""

NotServing = Callable[[], Awaitable[list[str]]]
"""Returns the names of the stages that are not serving ([] = healthy)."""

ParseRequest = Callable[[Any, str, SamplingOptions, GenerationConfig], ChatRequest]
"""A route's body parser (chat's, legacy completions'): (body, served model, defaults) -> request."""


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
        self._text_count_logged = False  # `_read_marker_ids`: reasoning tokens counted by their text

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
        # [\s\S]: any character, a newline (%0A) too, which `.` does not match.
        app.router.add_route(
            "*", r"/{path:[\s\S]*}", self._unrouted, name=UNROUTED, expect_handler=defer_continue
        )
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
        """A request's answer: refused before its handler runs (`http_checks.refusal`), or admitted (a body
        route's ticket) and handled; a cancel answered as the stop's 503 when it may be
        (`_cut_response`), aiohttp's own refusals as JSON errors; then recorded (`_answered`)."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None and resource.name != UNROUTED else UNROUTED
        request_id = tracing.begin_request(request.headers.get(tracing.REQUEST_ID_KEY, ""))
        span = tracing.RequestSpan(f"{request.method} {route}", request.headers)
        started = time.perf_counter()
        ticket = None
        try:
            if (refusal := http_checks.refusal(request, route, self.config)) is not None:
                response: web.StreamResponse = refusal
            elif request.method == "POST" and route in BODY_ROUTES:
                # With API keys, also counted per key (checked in `http_checks.refusal`): a tenant on many IPs.
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

    def _cut_response(self, request: web.Request, route: str, request_id: str) -> web.Response | None:
        """The answer to a request whose handler was cancelled: a 503 when the gateway's stop cut it
        before its answer began; None when the cancel must go on (its stream's 200 is out, or its
        client went away), counted in the metrics here."""
        if self.in_flight.cutting and not request.get(STREAM_BEGUN_KEY):
            # The gateway's stop cut it at the end of the grace period (`CallsInFlight.cut`),
            # whatever the route (/health, /metrics, the web demo's decode, a chat not begun):
            # a 503 to retry, counted as one. It was counted as a client gone (499) and its
            # connection dropped.
            return exception_response(self.in_flight.shutdown_error(0, current_request_id() or request_id))
        if self.in_flight.cutting:  # a stream whose 200 is out: only its connection can end
            self.metrics.http_responses.labels(route=route, code="200").inc()
            return None
        # Its client went away (aiohttp cancels the handler, `handler_cancellation`): nobody
        # reads an answer, the cancel goes on; one INFO line and a 499 in the metrics, as
        # for a client found gone by a read or a write (`client_gone_response`).
        log.info("client of %s went away", current_request_id() or request_id)
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
            response.headers[tracing.REQUEST_ID_KEY] = current_request_id() or request_id
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
            ask = self._ask_request(request, chat, await load_request_media(request, chat, self.config))
            events = self.pipeline.ask(ask)
            if chat.stream:
                return await self._stream(request, chat, ask.request_id, events)
            return await self._whole_answer(chat, events)
        except ConnectionResetError:
            # Its client closed the connection while sending its body: nothing to answer, and not
            # the server's fault (it was an ERROR traceback and a 500 for every such client).
            return client_gone_response(current_request_id(), "before its body arrived")
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

        def parsed(defaults: GenerationConfig) -> ChatRequest:
            return parse(body, self.config.http.served_model_name, self.config.sampling, defaults)

        # A malformed body is refused before any wait for the model's defaults (`check`).
        chat = parsed(await self.pipeline.request_defaults(self.config.generation, check=parsed))
        chat.generation = self.config.structured_outputs.applied(chat.generation)  # the server's options
        if chat.raw_prompt is None:  # legacy completions are not parted: they go on working
            chat.parser_on = self.config.http.parser_on
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
                chat.raw_prompt.token_ids, current_request_id()
            )
        return chat

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
                response_body, summary, chat, thinking, steps, read_marker_ids=self._read_marker_ids
            )
        return functools.partial(
            completion_body,
            summary,
            chat.model,
            role=chat.response_role,
            echoed=chat.echoed_text,
            thinking=thinking,
            include_reasoning=chat.include_reasoning,
            parser_on=chat.parser_on,
            tool_choice=chat.tool_choice,
            steps=steps,
            read_marker_ids=self._read_marker_ids,
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

    def _read_marker_ids(self) -> MarkerIds | None:
        """The served model's think markers' token ids as the gateway knows them now, by which a
        thinking answer's reasoning tokens are counted (`epd.gateway.reasoning.marker_ids`): each
        choice's `ReasoningStream` reads them at its first token (`MarkerIdsReader`), so an answer
        whose model info came after its request, before its first token, is counted by id. Not
        known (no model info yet, a prefill from before them, replicas that disagree), they are
        counted by where the text falls, which the first such answer logs once, for the operator."""
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
        if chat.responses is not None:
            shaper = ResponseEvents(chat, request_id, thinking, read_marker_ids=self._read_marker_ids)
            write = write_response_events(stream, shaper, events, log_summary)
        else:
            write = write_chat_events(
                stream, ChatChunks(chat, request_id, thinking, self._read_marker_ids), events, log_summary
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
