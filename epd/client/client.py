"""`AsyncEpdClient`, the asyncio gRPC client of the front door: its calls, their deadlines,
retries and errors. `EpdClient` (`epd.client.sync_client`) runs one on a private event loop and
has the same methods, blocking; the requests are built from the options in `epd.client.request`.

    with EpdClient("127.0.0.1:50050", api_key="KEY") as client:
        result = client.ask("clip.mp4", "what colour is the circle?", max_new_tokens=16)
        print(result.answer, result.timings_ms.ttft_ms, result.pruning, result.grid_thw)

        # A conversation: parts in your order, rendered with the model's own chat template.
        result = client.ask("clip.mp4", messages=[Message.user("in this clip", VIDEO, "what moves?")])

        for event in client.stream("clip.mp4", "and the square?"):   # StageEvent | TokenDelta | AskResult
            if isinstance(event, StageEvent) and event.stage == Stage.VIDEO_DECODE:
                ...

        # Follow-ups that see the earlier answers (`epd.client.conversation`).
        chat = client.conversation("clip.mp4", num_frames=8)
        chat.ask("how many objects are there?")
        chat.ask("which appears first?")

One call = one `GatewayService.Ask` stream: a header, the media in 1 MiB chunks (or only its
sha256 when the servers have it), then stage events, the prompt's logprobs in pieces (when
asked: joined into `AskResult.prompt_logprobs`), token deltas and a summary come back.
Every call has a deadline (`timeout_s`, per client or per call, covering retries); UNAVAILABLE
is retried before the first token only (`retry.RetryPolicy`); failures raise `EpdError` with
the gRPC status, the server's message, and `retry_after_s` when the server was busy.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import Message as ProtoMessage

from epd.client.channel import MAX_MESSAGE_BYTES, ChannelSettings, channel_credentials, open_channel
from epd.client.conversation import AsyncConversation
from epd.client.media import CHUNK_BYTES, Media, MediaSource
from epd.client.request import (
    MessageLike,
    build_header,
    check_options,
    conversation,
    detokenize_request,
    tokenize_request,
)
from epd.client.retry import RetryPolicy
from epd.client.types import (
    AskResult,
    EpdError,
    StageEvent,
    StreamEvent,
    TokenDelta,
    TokenizeResult,
    TokenLogprob,
    result_from_proto,
    stage_event_from_proto,
    tokenize_result_from_proto,
)
from epd.stages.messages import Message, media_type
from epd.transport.aio_cancel import cancelled_by_grpc, lost_while_sending
from epd.transport.message_convert import logprob_from_proto, logprobs_from_proto
from epd.transport.status_metadata import retry_after_in
from epd.transport.tracing import metadata_value
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

__all__ = ["AsyncEpdClient"]

MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - (64 << 10)
"""Largest `chunk_bytes`: room for the message's framing under gRPC's limit (larger chunks were
refused by the SDK's own channel, "Sent message larger than max")."""


async def _join_prompt_logprobs(joined: list[TokenLogprob], piece: common_pb2.PromptLogprobs) -> None:
    """`piece`'s entries made `TokenLogprob`s at the end of `joined`, the result's one list (the
    public `AskResult.prompt_logprobs` is a list: made once, entry by entry, no list of the piece's
    beside it), on a worker thread: a piece is about 50,000 entries, 0.3 s of Python, which on the
    client's event loop would stall every other call's stream that long (a blocking `EpdClient`'s
    calls share one loop too; docs/benchmarks.md, "Prompt logprobs on the event loop")."""
    await asyncio.to_thread(joined.extend, map(logprob_from_proto, piece.logprobs))


class AsyncEpdClient:
    """asyncio client; use `async with AsyncEpdClient(endpoint) as client:`. It may also be made
    before the event loop runs (`client = AsyncEpdClient(...)`, then `asyncio.run(main())`): its
    channel opens at the first call, in that call's loop, and serves that loop only.

    endpoint: "HOST:PORT" of the gateway. timeout_s: default deadline of one call (retries
    included). api_key: sent as `authorization: Bearer ...`. tls / root_certificates_path /
    server_name_override: a TLS channel; client_certificate_path / client_key_path: the
    certificate it presents to a gateway that requires one (mTLS). retry: when UNAVAILABLE is
    tried again.
    """

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 600.0,
        *,
        api_key: str = "",
        tls: bool = False,
        root_certificates_path: str = "",
        server_name_override: str = "",
        client_certificate_path: str = "",
        client_key_path: str = "",
        metadata: tuple[tuple[str, str], ...] = (),
        retry: RetryPolicy | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(
                f"timeout_s must be a positive number of seconds (every call has a deadline), got {timeout_s!r}"
            )
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be from 1 to {MAX_CHUNK_BYTES} (a chunk and its message framing fit "
                f"the {MAX_MESSAGE_BYTES >> 20} MiB gRPC message limit), got {chunk_bytes}"
            )
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.chunk_bytes = chunk_bytes
        self.settings = ChannelSettings(
            tls,
            root_certificates_path,
            server_name_override,
            api_key,
            tuple(metadata),
            client_certificate_path,
            client_key_path,
        )
        self._credentials = channel_credentials(self.settings)
        # Opened by the first call, in its event loop: grpc.aio binds a channel to the loop running
        # when it is made, and a client made before `asyncio.run(main())` (no loop yet, or
        # another) failed every call with "got Future attached to a different loop".
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _stub(self) -> gateway_pb2_grpc.GatewayServiceStub:
        loop = asyncio.get_running_loop()
        if self._channel is None:
            self._channel, self._loop = (
                open_channel(self.endpoint, self.settings, self.retry, self._credentials),
                loop,
            )
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncEpdClient made its calls in another event loop, and its channel belongs "
                "to that loop; make one client per event loop (e.g. inside the asyncio.run coroutine)"
            )
        return gateway_pb2_grpc.GatewayServiceStub(self._channel)

    async def ask_stream(
        self,
        video: Media | None,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        media_sha256: str = "",
        timeout_s: float | None = None,
        **options,
    ) -> AsyncGenerator[gateway_pb2.AskResponse, None]:
        """Deprecated (removed in 0.3): the raw AskResponse protos (events, token deltas, then
        the summary). Use `stream`, which yields the same as typed SDK objects."""
        warnings.warn(
            "ask_stream is deprecated (removed in 0.3); use stream()", DeprecationWarning, stacklevel=2
        )
        async with aclosing(
            self._responses(video, question, messages, media_sha256, timeout_s, options)
        ) as msgs:
            async for msg, _ in msgs:
                yield msg

    async def stream(
        self,
        video: Media | None,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        media_sha256: str = "",
        timeout_s: float | None = None,
        **options,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Yields `StageEvent`s and `TokenDelta`s as they happen, then one `AskResult`.

        video: a path, bytes or binary file object; None with `media_sha256` to reuse media the
        servers have seen (NOT_FOUND when they have not); None without it for a text-only
        conversation (the question alone, or messages without a media part: no encoder call, as
        vLLM answers text on a vision-language model). Options: see `build_header`.
        Leaving early (`aclose()`, or `async with contextlib.aclosing(...)` around a loop that
        breaks) cancels the call on the server."""
        events: list[StageEvent] = []
        prompt_logprobs: list[TokenLogprob] = []
        pieces_attempt = 0
        # aclosing: when this generator is closed early, the call is cancelled now (`_responses`'s
        # finally), not whenever the garbage collector gets to the inner generator.
        async with aclosing(
            self._responses(video, question, messages, media_sha256, timeout_s, options)
        ) as msgs:
            async for msg, meta in msgs:
                kind = msg.WhichOneof("kind")
                if kind == "prompt_logprobs":  # in pieces, before the first delta; kept for the result
                    if meta[0] != pieces_attempt:  # a retried call sends them all again
                        prompt_logprobs, pieces_attempt = [], meta[0]
                    await _join_prompt_logprobs(prompt_logprobs, msg.prompt_logprobs)
                elif kind == "event":
                    event = stage_event_from_proto(msg.event)
                    events.append(event)
                    yield event
                elif kind == "delta":
                    yield TokenDelta(
                        list(msg.delta.token_ids), msg.delta.text, logprobs_from_proto(msg.delta.logprobs)
                    )
                elif kind == "summary":
                    result = result_from_proto(msg.summary, events, prompt_logprobs or None)
                    result.num_attempts, result.media_num_bytes_sent = meta
                    yield result
                    return
        raise EpdError(grpc.StatusCode.INTERNAL, "the stream ended without a summary")

    async def ask(
        self,
        video: Media | None,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        media_sha256: str = "",
        timeout_s: float | None = None,
        **options,
    ) -> AskResult:
        """The whole answer at once (see `stream` for the options)."""
        items = self.stream(video, question, messages=messages, media_sha256=media_sha256, timeout_s=timeout_s,
                            **options)  # fmt: skip
        async with aclosing(items):  # a cancelled `ask` cancels its call now
            async for item in items:
                if isinstance(item, AskResult):
                    return item
        raise EpdError(grpc.StatusCode.INTERNAL, "the stream ended without a summary")

    def conversation(self, video: Media | None, *, system: str = "", **options) -> AsyncConversation:
        """A conversation about `video` (None: about text alone): each `await conv.ask(question)` sends the history (the
        video and first question, the earlier answers, then the new question) and appends its
        answer. `options` are `ask`'s (`timeout_s` included), for every turn; `system`: an
        optional system message first. See `epd.client.conversation`.

            chat = client.conversation("clip.mp4", num_frames=8)
            first = await chat.ask("how many objects are there?")
            second = await chat.ask("which appears first?")
        """
        check_options(options)
        return AsyncConversation(self, video, system=system, **options)

    async def upload_or_reuse(
        self,
        video: Media,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        timeout_s: float | None = None,
        **options,
    ) -> AskResult:
        """Ask by the video's sha256 first (no upload); on NOT_FOUND upload the bytes.

        Saves the upload when the encoder still caches this video with these sampling options;
        `result.media_num_bytes_sent` says which happened."""
        source = MediaSource(video, self.chunk_bytes)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        try:
            return await self.ask(
                None, question, messages=messages, media_sha256=source.sha256, timeout_s=timeout_s, **options
            )
        except EpdError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
        return await self.ask(
            source, question, messages=messages, timeout_s=max(0.0, deadline - time.monotonic()), **options
        )

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        return_token_strs: bool = False,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> TokenizeResult:
        """The token ids of a text, or of a text-only conversation rendered with the model's chat
        template exactly as `ask(None, messages=...)` renders its prompt (the HTTP API's
        /tokenize, vLLM's): `GatewayService.Tokenize`.

        prompt: a text, tokenised as it is; or messages: `Message`s or chat-form dicts without a
        video or image part (INVALID_ARGUMENT: their tokens depend on the frames sampled), ending
        with any role's message. add_special_tokens: None is vLLM's default (True for a prompt,
        False for messages). add_generation_prompt / continue_final_message /
        chat_template_kwargs / chat_template / tools: as `ask`'s (the default ends with the opening of a new answer, so
        `num_tokens` is that ask's `num_prompt_tokens`); messages only (INVALID_ARGUMENT with a
        prompt, as `ask(None, prompt=...)`). return_token_strs: also the tokenizer's token of each id."""
        request = tokenize_request(
            prompt,
            messages,
            add_special_tokens,
            add_generation_prompt,
            continue_final_message,
            return_token_strs,
            request_id,
            chat_template_kwargs,
            chat_template,
            tools,
        )
        answer = await self._unary("Tokenize", request, timeout_s)
        return tokenize_result_from_proto(answer, return_token_strs)

    async def detokenize(
        self, token_ids: Sequence[int], *, request_id: str = "", timeout_s: float | None = None
    ) -> str:
        """The text of token ids of the served model's vocabulary, special tokens kept (the HTTP
        API's /detokenize): `GatewayService.Detokenize`. INVALID_ARGUMENT for an id outside the
        vocabulary, or more than 262,144 ids."""
        request = detokenize_request(token_ids, request_id)
        return (await self._unary("Detokenize", request, timeout_s)).text

    async def _responses(
        self,
        video: Media | None,
        question: str | None,
        messages: Sequence[MessageLike] | None,
        media_sha256: str,
        timeout_s: float | None,
        options: dict[str, Any],
    ) -> AsyncGenerator[tuple[gateway_pb2.AskResponse, tuple[int, int]], None]:
        """The call with its retries; yields (message, (attempt number, media bytes sent))."""
        source = None
        if video is not None:
            source = MediaSource(video, self.chunk_bytes)
        elif not media_sha256:
            if question is not None:  # no media: the question alone, a text-only conversation
                messages = [Message.user(question)]
                question = None
            elif messages is not None and media_type(conversation(messages)):
                raise ValueError(
                    "the messages have a video or image part: pass the video (path, bytes or file object) "
                    "or the media_sha256 of one the server has"
                )
        header = build_header(
            question,
            source.num_bytes if source else 0,
            source.sha256 if source else media_sha256,
            options,
            messages,
        )
        if (num_bytes := header.ByteSize()) > MAX_MESSAGE_BYTES:
            # gRPC would refuse to send it with its own words ("Sent message larger than max
            # (5000022 vs. 4194304)"), naming neither the conversation nor what to change.
            raise EpdError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request's conversation and settings are {num_bytes} bytes, over the "
                f"{MAX_MESSAGE_BYTES >> 20} MiB one gRPC message may carry; send a shorter conversation",
            )
        timeout_s_used = timeout_s if timeout_s is not None else self.timeout_s
        deadline = time.monotonic() + timeout_s_used
        attempt = 0
        while True:
            attempt += 1
            saw_token = False
            call = None
            try:
                call = self._stub().Ask(
                    _requests(header, source),
                    timeout=max(0.0, deadline - time.monotonic()),
                    metadata=self.settings.call_metadata(),
                )
                async for msg in call:
                    saw_token = saw_token or msg.WhichOneof("kind") == "delta"
                    yield msg, (attempt, source.num_bytes if source else 0)
                return
            except grpc.aio.AioRpcError as exc:
                error = _call_error(exc, deadline, timeout_s_used, "or ask for fewer tokens or frames")
            except asyncio.CancelledError:
                if not cancelled_by_grpc():
                    raise  # our caller cancelled this call
                # grpc.aio's own cancel: the request could not be written (epd.transport.aio_cancel).
                late = _past(deadline)
                error = EpdError(
                    grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED,
                    "the deadline passed before the request was sent; raise timeout_s"
                    if late
                    else "gRPC cancelled the call: its request could not be sent (did reading the media fail?)",
                )
            finally:
                # A consumer that stops reading (a `break`, `aclose()`, its task cancelled) leaves
                # this generator at the yield: grpc.aio would go on receiving the answer, and the
                # servers go on generating it, until it completes. Cancelling ends it there now.
                if call is not None and not call.done():
                    call.cancel()
            await self._before_retry(error, attempt, saw_token, deadline)

    async def _before_retry(self, error: EpdError, attempt: int, saw_token: bool, deadline: float) -> None:
        """Wait before trying the call again, or raise `error` when the retry policy (or the
        deadline) says not to."""
        wait_s = max(self.retry.backoff_s(attempt), error.retry_after_s or 0)
        busy = error.retry_after_s is not None
        if (
            not self.retry.should_retry(error.code, attempt, saw_token, busy)
            or time.monotonic() + wait_s >= deadline
        ):
            raise error from None
        await asyncio.sleep(wait_s)

    async def _unary(self, method: str, request: ProtoMessage, timeout_s: float | None) -> Any:
        """One unary call of the gateway, retried as `ask` is before its first token."""
        timeout_s_used = timeout_s if timeout_s is not None else self.timeout_s
        deadline = time.monotonic() + timeout_s_used
        attempt = 0
        while True:
            attempt += 1
            try:
                return await getattr(self._stub(), method)(
                    request,
                    timeout=max(0.0, deadline - time.monotonic()),
                    metadata=self.settings.call_metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                error = _call_error(exc, deadline, timeout_s_used)
            await self._before_retry(error, attempt, False, deadline)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncEpdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _call_error(
    exc: grpc.aio.AioRpcError, deadline: float, timeout_s_used: float, also_helps: str = ""
) -> EpdError:
    """The SDK's error for a failed call: the server's status and message, gRPC's own words for
    a send cut short or our deadline replaced by what to change (`also_helps`: what else does, for
    this call, after "raise timeout_s")."""
    code, message = exc.code(), exc.details() or ""
    request_id = metadata_value(exc.trailing_metadata())
    exhausted = code == grpc.StatusCode.RESOURCE_EXHAUSTED  # the mark means "busy" on it only
    retry_after_s = retry_after_in(exc.trailing_metadata()) if exhausted else None
    if lost_while_sending(code, message):
        # grpc.aio's own INTERNAL for a send the call's end cut short: by the deadline, or by a
        # connection that broke (the server is gone: retried as UNAVAILABLE).
        code, message = (
            (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the deadline passed while the request was being sent; raise timeout_s",
            )
            if _past(deadline)
            else (grpc.StatusCode.UNAVAILABLE, "the connection broke while the request was being sent")
        )
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and _past(deadline):
        # Our own deadline (gRPC's text: "Deadline Exceeded"), not a server's message.
        message = f"no answer within the call's deadline ({timeout_s_used:g} s, timeout_s); raise timeout_s"
        if also_helps:
            message += f", {also_helps}"
    return EpdError(code, message, retry_after_s, request_id)


DEADLINE_CLOCK_SLACK_S = 0.005
"""gRPC times a call's deadline on its own clock, from a moment just after ours: an error its
deadline caused may reach us a hair before `deadline` by our clock."""


def _past(deadline: float) -> bool:
    return time.monotonic() >= deadline - DEADLINE_CLOCK_SLACK_S


async def _requests(header: gateway_pb2.AskHeader, source: MediaSource | None):
    yield gateway_pb2.AskRequest(header=header)
    if source is not None:
        for chunk in source.chunks():
            yield gateway_pb2.AskRequest(media_chunk=chunk)
