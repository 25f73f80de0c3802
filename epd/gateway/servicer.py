"""GatewayService over gRPC: read the upload, run the pipeline on the header's messages, stream
events, the prompt's logprobs (in pieces) and tokens; Tokenize and Detokenize answer with the pipeline's calls the HTTP API's
/tokenize and /detokenize make."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from functools import partial

from epd.gateway.admission import Admission, Overloaded, Ticket, peer_host
from epd.gateway.ask_types import AskRequest, AskSummary, PromptLogprobs
from epd.gateway.config import GatewayConfig
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.shutdown import Call, CallsInFlight
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import StageEvent, TokenStep, check_cache_salt
from epd.stages.deadline import set_client_deadline
from epd.stages.errors import DeadlineExceeded, InvalidRequest
from epd.stages.messages import Message, question_messages
from epd.stages.names import Stage, timings_with_legacy_names
from epd.stages.raw_prompt import RawPrompt
from epd.stages.request_id import current_request_id
from epd.transport import convert, tracing
from epd.transport.aio_cancel import within
from epd.transport.auth import bearer_token, request_cache_salt
from epd.transport.errors import code_of, rpc_errors
from epd.transport.internal_secrets import internal_secrets
from epd.transport.model_info import public_tokenize_input_from_proto, tokenize_answer_to_proto
from epd.transport.server import CUT_MARGIN_S
from epd.transport.upload import drain, media_input, read_header, read_media
from epd.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


@dataclass
class _Outcome:
    answered: bool = False
    """A streamed call's last message (its summary) was handed to gRPC: a client that cancels
    then, having the whole answer (the SDK cancels as it returns), is counted OK, not CANCELLED."""


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        config: GatewayConfig,
        pipeline: Pipeline,
        admission: Admission | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = metrics
        """Where each call's status is counted (`epd_grpc_responses_total`); None: not counted."""
        # Shared with the HTTP API when both run (epd.gateway.server.main): a client's limit counts both.
        self.admission = admission or Admission.of_gateway(config)
        self.in_flight = CallsInFlight()
        """The Ask calls answering now, ended with their own status at shutdown (`epd/gateway/shutdown.py`)."""

    async def cut_calls_in_flight(self, hurried: bool) -> None:
        await self.in_flight.cut_and_wait(CUT_MARGIN_S, hurried)

    @rpc_errors
    async def Ask(self, request_iterator, context):
        with self._counted("Ask") as outcome, self.in_flight.tracking() as call:
            try:
                # aclosing: a client that goes away closes this generator at its yield; `_ask`'s
                # own cleanup must run then too, not when the GC finds it.
                async with aclosing(self._ask(request_iterator, context, call)) as responses:
                    async for response in responses:
                        # The answer is whole once its summary goes: a client that has it may
                        # cancel before the status (the SDK does, as it returns), even while gRPC
                        # still holds this task in the summary's send; not a cancelled call.
                        outcome.answered = response.WhichOneof("kind") == "summary"
                        with call.sending():  # gRPC holds the task until the message is sent
                            yield response
            except asyncio.CancelledError:
                if not call.was_cut:
                    raise  # its client went away
                raise self.in_flight.shutdown_error(call.num_tokens, call.request_id) from None

    @rpc_errors
    async def Tokenize(self, request, context):
        with self._counted("Tokenize"), self._unary_call(context, request.ByteSize()):
            request_id = tracing.adopt_request_id(request.request_id)
            answer = await self.pipeline.tokenize(public_tokenize_input_from_proto(request), request_id)
            return tokenize_answer_to_proto(answer)

    @rpc_errors
    async def Detokenize(self, request, context):
        with self._counted("Detokenize"), self._unary_call(context, request.ByteSize()):
            request_id = tracing.adopt_request_id(request.request_id)
            text = await self.pipeline.detokenize(list(request.token_ids), request_id)
            return gateway_pb2.GatewayServiceDetokenizeResponse(text=text)

    @contextmanager
    def _counted(self, method: str) -> Iterator[_Outcome]:
        """Count the call under the status its client gets: the one `rpc_errors` maps its error
        to (a shutdown's cut included: `shutdown_error`), CANCELLED when its client went away
        before it had the whole answer (OK after: `_Outcome.answered`)."""
        code = "OK"
        outcome = _Outcome()
        try:
            yield outcome
        except (asyncio.CancelledError, GeneratorExit):
            code = "OK" if outcome.answered else "CANCELLED"
            raise
        except Exception as exc:
            code = code_of(exc).name  # not status_of: `rpc_errors` logs what it logs, once
            raise
        finally:
            if self.metrics is not None:
                self.metrics.grpc_responses.labels(method=method, code=code).inc()

    def count_refused(self, method: str, code: str) -> None:
        """Count a call the API key check refused before it reached this servicer (`method`:
        "/epd.v1.GatewayService/Ask"), under the same label a call that reached it has ("Ask")."""
        if self.metrics is not None:
            self.metrics.grpc_responses.labels(method=method.rpartition("/")[2], code=code).inc()

    def _admit(self, context) -> Ticket:
        """A request slot for the caller's address and API key (the interceptor checked the key),
        shared with the HTTP API; Overloaded when it has its limit in flight."""
        key = bearer_token(context.invocation_metadata()) if self.config.http.api_keys else ""
        return self.admission.admit(peer_host(context.peer()), key)

    @contextmanager
    def _unary_call(self, context, num_request_bytes: int) -> Iterator[Call]:
        """A unary call admitted as an HTTP body is (a slot, its request's bytes reserved) and
        ended with the gateway's own status if the shutdown cuts it. Its stage calls last no
        longer than its client waits (epd.stages.deadline)."""
        set_client_deadline(context.time_remaining())
        with self.in_flight.tracking() as call:
            try:
                with self._admit(context) as ticket:
                    ticket.reserve_bytes(num_request_bytes)
                    yield call
            except asyncio.CancelledError:
                if not call.was_cut:
                    raise  # its client went away
                raise self.in_flight.shutdown_error(0, current_request_id()) from None

    def _ask_request(self, header, data: bytes, context, defaults: GenerationConfig) -> AskRequest:
        """The pipeline's request for an Ask whose header and media are `header` and `data`, under
        the request `defaults`; InvalidRequest for a malformed one."""
        raw_prompt = raw_prompt_of(header)
        request = AskRequest(
            messages=[]
            if raw_prompt is not None
            else messages_of(header, media_sent=bool(data or header.media_sha256)),
            raw_prompt=raw_prompt,
            template=convert.template_from_proto(header.template),
            media=media_input(header, data),
            sampling=convert.sampling_from_proto(header.sampling, self.config.sampling, from_client=True),
            generation=self.config.structured_outputs.applied(  # the server's options
                convert.generation_from_proto(header.generation, defaults)
            ),
            request_id=tracing.adopt_request_id(header.request_id),
            pruning=convert.pruning_from_proto(header.pruning),
            cache_salt=request_cache_salt(
                bool(self.config.http.api_keys),
                bearer_token(context.invocation_metadata()),
                check_cache_salt(header.cache_salt),
                internal_secrets(self.config.server.security).presented,
            ),
        )
        if request.generation.n != 1:
            raise InvalidRequest(
                f"generation.n is {request.generation.n}, but Ask streams one answer: ask the HTTP API "
                "(/v1/chat/completions, /v1/completions) for n choices, or send n requests (each with "
                "its own seed); leave n unset or 1"
            )
        return request

    async def _ask(self, request_iterator, context, call: Call):
        started = time.perf_counter()
        # The stage calls made for it last no longer than its client waits (epd.stages.deadline).
        set_client_deadline(context.time_remaining())
        try:
            ticket = self._admit(context)
        except Overloaded:
            await drain(request_iterator)  # so that the client sees our status, not INTERNAL
            raise
        with ticket:
            header, data = await self._read_upload(request_iterator, ticket.reserve_bytes)
            upload_ms = (time.perf_counter() - started) * 1e3
            uploaded = StageEvent(Stage.UPLOAD, "finished", upload_ms, {"num_bytes": str(len(data))})
            yield gateway_pb2.AskResponse(event=convert.event_to_proto(uploaded, upload_ms))
            # A malformed header is refused before any wait for the model's defaults (`check`).
            ask = partial(self._ask_request, header, data, context)
            request = ask(await self.pipeline.request_defaults(self.config.generation, check=ask))
            call.request_id = request.request_id
            # aclosing: when the client goes away, the pipeline's cleanup (cancel the stage call
            # in flight, release a KV cache not yet pulled) runs now, not when the GC finds it.
            events = self.pipeline.ask(request)
            async with aclosing(events):  # type: ignore[type-var]
                async for item in events:
                    if isinstance(item, StageEvent):
                        at_ms = (time.perf_counter() - started) * 1e3
                        yield gateway_pb2.AskResponse(event=convert.event_to_proto(item, at_ms))
                    elif isinstance(item, AskSummary):
                        yield gateway_pb2.AskResponse(summary=summary_to_proto(item))
                    # In pieces, as no message bounds them: prefill's own, forwarded as they came
                    # (the embedded pipeline's list is cut into pieces on worker threads).
                    elif isinstance(item, PromptLogprobs):
                        async for piece in convert.prompt_logprobs_pieces_off_loop(item.prompt_logprobs):
                            yield gateway_pb2.AskResponse(prompt_logprobs=piece)
                    elif isinstance(item, TokenStep):
                        call.num_tokens += len(item.token_ids)
                        delta = gateway_pb2.TokenDelta(
                            token_ids=item.token_ids,
                            text=item.text,
                            logprobs=[convert.logprob_to_proto(lp) for lp in item.logprobs or ()],
                        )
                        yield gateway_pb2.AskResponse(delta=delta)

    async def _read_upload(self, request_iterator, reserve_bytes) -> tuple[gateway_pb2.AskHeader, bytes]:
        """The header and the media, all within --body-timeout: a client that trickles its
        chunks, or stops, held its upload's bytes of the body budget and its request slot for as
        long as it liked (the HTTP API's bodies have the same limit)."""
        timeout_s = self.config.body_timeout_s
        ends_at = time.monotonic() + timeout_s
        try:
            header = await within(read_header(request_iterator), timeout_s)
            # The client's id from here on: the upload's errors, the response metadata and the
            # summary all name it.
            tracing.adopt_request_id(header.request_id)
            media = read_media(request_iterator, header, self.config.max_upload_bytes, reserve_bytes)
            return header, await within(media, max(0.0, ends_at - time.monotonic()))
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            raise DeadlineExceeded(
                f"the upload did not arrive within {timeout_s:g} s (the server's --body-timeout); send it "
                "faster, or a smaller or more compressed video"
            ) from None


def messages_of(header: gateway_pb2.AskHeader, media_sent: bool) -> list[Message]:
    """The header's conversation; the deprecated `question` (until 0.3) is [user: media, question].
    That form is documented as a question about the media, so with no media sent (no bytes, no
    media_sha256) it is refused here, saying what to send, rather than read as text alone (a
    meaning 0.1 never gave it) or passed to the encoder, whose "media is empty" would not say
    that a text-only question goes in messages."""
    if header.messages and header.question:
        raise InvalidRequest("send the conversation in messages or a single question, not both")
    if header.messages:
        return convert.messages_from_proto(header.messages)
    if header.question and not media_sent:
        raise InvalidRequest(
            "the deprecated question field asks about the uploaded media, and none was sent: send the video or "
            "image (media_chunk bytes, or media_sha256), or, for a question without media, send messages = "
            '[{role: "user", parts: [{type: "text", text: QUESTION}]}] instead of question'
        )
    return question_messages(header.question)


def raw_prompt_of(header: gateway_pb2.AskHeader) -> RawPrompt | None:
    """The header's raw prompt (`AskHeader.prompt`), None when it has none; it goes alone."""
    if not header.HasField("prompt"):
        return None
    if header.messages or header.question:
        raise InvalidRequest("send a raw prompt, messages or a question, only one of them")
    return convert.raw_prompt_from_proto(header.prompt)


def summary_to_proto(s: AskSummary) -> gateway_pb2.AskSummary:
    pruning = convert.stats_to_proto(s.pruning)
    # The gateway's own count (the stages' reports leave it out): in this answer only.
    pruning.transfer_bytes = s.pruning.transfer_bytes
    summary = gateway_pb2.AskSummary(
        request_id=s.request_id,
        answer=s.answer,
        token_ids=s.token_ids,
        finish_reason=s.finish_reason,
        num_frames=s.num_frames,
        num_visual_tokens=s.num_visual_tokens,
        num_prompt_tokens=s.num_prompt_tokens,
        timings_ms=timings_with_legacy_names(s.timings_ms),  # "decode" too, until 0.3
        kv_num_bytes=s.kv_num_bytes,
        encoder_cache_hit=s.encoder_cache_hit,
        media_sha256=s.media_sha256,
        frame_timestamps_s=s.frame_timestamps_s,
        pruning=pruning,
        grid_thw=list(s.grid_thw),
        kept_visual_token_index=s.kept_visual_token_index,
        num_reused_prompt_tokens=s.num_reused_prompt_tokens,
        logprobs=[convert.logprob_to_proto(lp) for lp in s.logprobs or ()],
        prompt_token_ids=s.prompt_token_ids or (),
    )
    return convert.set_stop_reason(summary, s.stop_reason)
