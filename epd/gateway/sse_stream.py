"""A streamed answer of the HTTP API over server-sent events (aiohttp): its response, begun (200
and headers) by its first token or by the first keep-alive comment, whichever comes first
(`SseStream`); the chat and legacy completion stream's writer (`write_chat_events`: the chunks of
`epd.gateway.chat_chunks.ChatChunks` as `data:` lines, then `data: [DONE]`) and the Responses
API's (`write_response_events`: the events of `epd.gateway.responses_events.ResponseEvents` as
`event:` and `data:` pairs, no [DONE]). An error after the 200 is the stream's last event, with
the error's OpenAI body; one before it raises, so that the handler answers with its own status.
A client gone is a ConnectionResetError from any write, which the handler answers
(`epd.gateway.http_api.client_gone_response`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

from aiohttp import web

from epd.gateway.ask_types import AskSummary, PipelineEvent, PromptLogprobs, PromptTokenIds
from epd.gateway.chat_chunks import ChatChunks
from epd.gateway.http_errors import error_body, http_error_of
from epd.gateway.json_answer import json_bytes
from epd.gateway.responses_events import ResponseEvents
from epd.gateway.shutdown import CallsInFlight, current_call
from epd.stages.contracts import StageEvent, TokenStep
from epd.transport import tracing

log = logging.getLogger(__name__)

STREAM_ERROR_KEY = web.RequestKey("epd_stream_error_status", int)
"""The status of the error event a streamed answer ended with, for the request's log line: the
response itself went out as 200 with the first token."""

STREAM_BEGUN_KEY = web.RequestKey("epd_stream_begun", bool)
"""Set once a streamed answer's 200 and headers went out: no other response can follow them."""

OnSummary = Callable[[AskSummary], None]
"""What the handler does with the answer's summary as it passes (its log line)."""


class SseStream:
    """A streamed answer's response, once its first token or keep-alive made it (None before).
    `in_flight`: the server's answers in flight, whose cut at shutdown ends this one with an
    error event; `keepalive_s`: the comment line's period until the first token (0: none)."""

    def __init__(
        self, request: web.Request, request_id: str, in_flight: CallsInFlight, keepalive_s: float
    ) -> None:
        self.request = request
        self.request_id = request_id
        self.in_flight = in_flight
        self.keepalive_s = keepalive_s
        self.response: web.StreamResponse | None = None
        self.answering = False
        """The first chunk (the assistant's role) is being or has been sent."""
        self._lock = asyncio.Lock()

    async def run(self, write: Awaitable[None]) -> None:
        """Runs `write` (`write_chat_events`, `write_response_events`), with keep-alives until its
        first token; raises ConnectionResetError when the client is gone."""
        keep_alive = None
        if self.keepalive_s > 0:
            keep_alive = asyncio.ensure_future(self._keep_alive())
        try:
            await write
        finally:
            if keep_alive is not None:
                keep_alive.cancel()
                await asyncio.wait([keep_alive])

    async def begin(self) -> web.StreamResponse:
        """The response, sent (200 and headers) by whichever comes first, the first token or a
        keep-alive; `response` is set only once the headers are out, so a writer never finds
        it unprepared."""
        async with self._lock:
            if self.response is None:
                response = web.StreamResponse(
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        tracing.REQUEST_ID_KEY: self.request_id,
                    }
                )
                await response.prepare(self.request)
                self.request[STREAM_BEGUN_KEY] = True
                self.response = response
            return self.response

    async def settled(self) -> web.StreamResponse | None:
        """The response once no keep-alive can begin one any more (None: nothing was sent). A
        keep-alive sending the headers right as the answer failed would otherwise leave the
        handler answering with a status on a connection that already had its 200."""
        self.answering = True
        async with self._lock:
            return self.response

    async def failed(self, exc: BaseException, num_tokens: int) -> tuple[web.StreamResponse, dict[str, Any]]:
        """A streamed answer's failure: (its response, already 200, and the error's body to send on
        it); raises the error itself when nothing was sent yet (the caller answers with its own
        status), or the cancel when its client went away."""
        if isinstance(exc, asyncio.CancelledError):
            if not self.in_flight.cutting:
                raise exc  # its client went away
            exc = self.in_flight.shutdown_error(num_tokens, self.request_id)
        if (response := await self.settled()) is None:
            raise exc  # nothing sent yet: the caller answers with the error's own status
        status, error_type, message = http_error_of(exc)
        self.request[STREAM_ERROR_KEY] = status
        if status == 500:
            log.exception("internal error mid-stream in %s", self.request_id, exc_info=exc)
        return response, error_body(tracing.with_request_id(message, self.request_id), error_type, status)

    async def _keep_alive(self) -> None:
        """Until the first token: after every `keepalive_s` without one, an SSE comment line,
        which clients skip (the OpenAI SDK's parser among them), so that a proxy's idle timeout
        (nginx's proxy_read_timeout: 60 s) does not cut a request whose media takes long to decode
        and encode. The first one sends the 200 and the headers: an error after it is an error
        event in the stream, as one after the first token is (vLLM answers 200 at once)."""
        try:
            while not self.answering:
                await asyncio.sleep(self.keepalive_s)
                if self.answering:
                    return
                response = await self.begin()
                await response.write(b": keep-alive\n\n")
        except ConnectionResetError:
            return  # the client went away: the request's own task finds out at its next write


async def write_chat_events(
    stream: SseStream, chunks: ChatChunks, events: AsyncIterator[PipelineEvent], on_summary: OnSummary
) -> None:
    """A chat answer's or a legacy completion's chunks, each a `data:` line, then `data: [DONE]`;
    the 200 goes with the first token (or the first keep-alive)."""
    call = current_call()

    async def send(make: Callable[[], list[dict[str, Any]]]) -> None:
        """`make()`'s chunks, each a `data:` line; made and written off the event loop while they
        may carry the prompt's logprobs (a completion's echo: up to half a million entries)."""
        assert stream.response is not None
        if chunks.echo_is_costly:
            lines = await asyncio.to_thread(lambda: [json_bytes(body) for body in make()])
        else:
            lines = [json.dumps(body).encode() for body in make()]
        for line in lines:
            await stream.response.write(b"data: " + line + b"\n\n")

    try:
        async with aclosing(events):  # type: ignore[type-var]
            async for item in events:
                if isinstance(item, (StageEvent, PromptLogprobs, PromptTokenIds)):
                    chunks.note(item)
                    continue  # stage events have no place in OpenAI's format
                if not isinstance(item, (TokenStep, AskSummary)):
                    continue
                if not stream.answering:
                    stream.answering = True  # no keep-alive from now on
                    await stream.begin()
                    for index in range(chunks.chat.generation.n):  # each choice's opening, as vLLM's
                        await send(partial(chunks.opening, index))
                        await send(partial(chunks.echo, index))
                if isinstance(item, TokenStep):
                    await send(partial(chunks.add, item))
                    if call is not None:  # what a cut's status (and the request metric) goes by
                        call.num_tokens = chunks.num_tokens
                    continue
                on_summary(item)
                await send(partial(chunks.finish, item))
    except ConnectionResetError:
        raise
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - mapped in status_of
        response, body = await stream.failed(exc, chunks.num_tokens)
        await send(chunks.cut)  # the last tokens held back for the summary that never came
        await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    if stream.response is None:
        raise RuntimeError("the pipeline ended without a token")
    await stream.response.write(b"data: [DONE]\n\n")
    await stream.response.write_eof()


async def write_response_events(
    stream: SseStream, shaper: ResponseEvents, events: AsyncIterator[PipelineEvent], on_summary: OnSummary
) -> None:
    """A Responses API answer's semantic events (`ResponseEvents`), each an SSE `event:` and
    `data:` pair; the 200 goes with the first token, as chat's; no [DONE] (OpenAI's stream
    ends with response.completed)."""
    call = current_call()
    num_tokens = 0

    async def send(items: list[dict[str, Any]]) -> None:
        assert stream.response is not None
        for event in items:
            await stream.response.write(sse_event(event))

    try:
        async with aclosing(events):  # type: ignore[type-var]
            async for item in events:
                if not isinstance(item, (TokenStep, AskSummary)):
                    continue  # stage events and the prompt's logprobs and ids have no place in the format
                if not stream.answering:
                    stream.answering = True  # no keep-alive from now on
                    await stream.begin()
                    await send(shaper.start())
                if isinstance(item, TokenStep):
                    num_tokens += len(item.token_ids)
                    if call is not None:  # what a cut's status (and the request metric) goes by
                        call.num_tokens = num_tokens
                    await send(shaper.add(item.text, item.token_ids, item.logprobs))
                    continue
                on_summary(item)
                await send(shaper.finish(item))
    except ConnectionResetError:
        raise
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - mapped in status_of
        response, body = await stream.failed(exc, num_tokens)
        for event in shaper.failed(body):
            await response.write(sse_event(event))
    if stream.response is None:
        raise RuntimeError("the pipeline ended without a token")
    await stream.response.write_eof()


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event named by its type, as OpenAI's Responses stream frames them."""
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"
